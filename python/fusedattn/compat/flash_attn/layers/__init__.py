"""flash-attention's `flash_attn.layers`: the rotary embedding (`rotary`)."""
