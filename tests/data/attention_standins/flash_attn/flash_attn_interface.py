"""flash_attn 2.x's functional interface with its real signatures, computed by plain attention."""
import torch

from _reference import attention


def _bthd(q, k, v, softmax_scale, causal, mask=None):
    o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, causal, mask)
    return o.transpose(1, 2)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return _bthd(q, k, v, softmax_scale, causal)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return _bthd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale, causal)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return _bthd(q, kv[:, :, 0], kv[:, :, 1], softmax_scale, causal)


def _varlen(q, k, v, cu_q, cu_k, softmax_scale, causal):
    outs = []
    for s in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[s]:cu_q[s + 1]], k[cu_k[s]:cu_k[s + 1]], v[cu_k[s]:cu_k[s + 1]]
        outs.append(_bthd(qs[None], ks[None], vs[None], softmax_scale, causal)[0])
    return torch.cat(outs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    return _varlen(q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), softmax_scale, causal)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    cu = cu_seqlens.tolist()
    return _varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, softmax_scale, causal)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return _varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), softmax_scale, causal)
