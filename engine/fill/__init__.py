"""Token fast-forwarding (§7 of ``speculative-decoding.md``): one ``ProposalSource``
interface with the assert and verify policies (:mod:`engine.fill.proposal`), the echo tier
(:mod:`engine.fill.echo`) and the strict tier's scaffold compiler (:mod:`engine.fill.strict`)."""
