"""vLLM's call signatures: MoE routing (routing), indexer top-k per row (topk) and mHC ops (mhc).

`from flashkern.compat.vllm import fused_topk_bias` replaces `from vllm.model_executor.layers.fused_moe...
import fused_topk_bias`; each module's docstring names the vLLM functions it mirrors.
"""

from flashkern.compat.vllm.mhc import *  # noqa: F401,F403
from flashkern.compat.vllm.routing import *  # noqa: F401,F403
from flashkern.compat.vllm.topk import *  # noqa: F401,F403
