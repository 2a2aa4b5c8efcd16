"""Drop-in replacements for other libraries' attention APIs, running fusedattn's kernels.

`fusedattn.compat.flash_attn`: flash-attention 2's `flash_attn_func`, `flash_attn_varlen_func`
and `flash_attn_with_kvcache`, so a codebase switches by changing its import.
`fusedattn.compat.flash_mla`: FlashMLA's `get_mla_metadata` and `flash_mla_with_kvcache` (the
dense MLA decode) on fusedattn's Triton MLA kernel, any GPU Triton runs on.
`fusedattn.compat.flex_attention`: FlexAttention's `flex_attention` and `create_block_mask`,
eager (no compile), block masks and score_mods on the Triton kernels (docs/block_masks.md).
"""
