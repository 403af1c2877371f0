"""DeepSeek-V3 (grouped sigmoid routing with a bias, shared experts; no auxiliary loss): its
experts are spread by its own expert plan, and it computes no auxiliary router loss, so none is
made the global batch's. Registered so that gridtrain knows it (an unregistered family's router
loss is warned about)."""

from gridtrain.hf.families.registry import Family, register_family
from gridtrain.hf.moe.families import MoeFamily

NOTE = "grouped sigmoid routing with a bias, shared experts; no auxiliary loss"
FAMILY = register_family(Family("deepseek_v3", moe=MoeFamily(None, note=NOTE), note="DeepSeek-V3"))
