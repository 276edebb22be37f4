"""Compatibility entry points: the call signatures and return conventions of the engines our users come from.

    flashkern.compat.vllm        vLLM's MoE routing, indexer top-k and mHC ops
    flashkern.compat.deep_gemm   DeepGEMM's indexer (MQA logits) functions

Each function takes the peer's own layouts and arguments and lands on a flashkern operator (any backend), so a
user switches by changing an import. Where the peer's behaviour differs from ours, the function's docstring
says how, and the README's "Conventions" section lists it per operator.
"""
