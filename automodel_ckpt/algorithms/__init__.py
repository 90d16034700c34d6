"""Training algorithms, one folder each; importing this package registers each one's recipe section."""

from automodel_ckpt.algorithms.dpo.config import SECTION as _DPO
from automodel_ckpt.algorithms.grpo.config import SECTION as _GRPO
from automodel_ckpt.config.sections import register_section

register_section(_DPO)
register_section(_GRPO)
