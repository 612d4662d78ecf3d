"""SeqFT: full fine-tuning, task after task.

Update: AdamW on the answer-only cross-entropy of task t over all parameters,
constant lr 1e-5, betas (0.9, 0.95), weight decay 0, clip 1.0; weights and Adam
moments carry across tasks, never reset (TRACE, scripts/train_seq_naive.sh).
"""
from cl_bench.method import Method
from cl_bench.registry import register_method


@register_method("seqft")
class SeqFT(Method):
    description = "Sequential full fine-tuning (TRACE's SeqFT): all weights, AdamW carried across tasks"
    lr_family = "full"
    baseline = True
