"""What two op families share, so that neither imports the other: torch's SDPA wrapped to
fusedattn's semantics with its refusals (sdpa.py: the torch backend of attention, the packed
batch, the paged prefill and decoding), and the Triton decode kernel's launcher and the cache
append (decode_launch.py: KV-cache decoding and the paged prefill). Imports only ops.core and
the level-0 modules."""
