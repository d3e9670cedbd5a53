"""Stand-in for flash_attn (the real one needs CUDA): same names and signatures, (B, T, H, D) layout."""
from flash_attn.flash_attn_interface import (  # noqa: F401
    flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
)
