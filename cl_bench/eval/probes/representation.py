"""Representation probes: how far each layer's representation of an earlier task
has moved since that task was learned (the data behind `cl-bench analyze`'s CKA
figure, the upcycling paper's figure 4a).

After every stage the probe runs the model, teacher-forced, on a fixed probe set
of each task trained so far: the first `n_examples` test examples of the task
(prompt + answer + EOS, as in training), keeping at most `max_tokens` of their
non-pad tokens, evenly spaced. For each decoder layer l it takes the layer's
output at those tokens, Phi_l: [tokens, d]. The first time a task is probed (the
stage that trained it) Phi_l becomes the task's reference; at every later stage
the probe records

    CKA_l(task j, stage b) = linear CKA(Phi_l after stage b, Phi_l after stage j)

(cl_bench/eval/probes/cka.py; 1 = the geometry of the task's representation is unchanged).
Outputs of decoder layer l are transformers' hidden_states[l + 1]; for Llama-style
models the last one has the final norm applied, which CKA does not see through
(scale per token changes it slightly), so the last layer is the final-norm output.

The references live in the method-independent probe state (checkpointed, so a
resumed run keeps them); only the CKA values reach the run record.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cl_bench.eval.probes.cka import linear_cka
from cl_bench.models.modes import device_of, eval_mode
from cl_bench.data.encode import Encoder, collate


class RepresentationProbe:
    def __init__(self, n_examples: int, max_tokens: int = 512, batch_size: int = 4):
        if n_examples < 1:
            raise ValueError("n_examples must be >= 1")
        self.n_examples = n_examples
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.references: dict[str, list[torch.Tensor]] = {}  # task -> per layer [tokens, d]

    @torch.no_grad()
    def features(self, model: nn.Module, encoder: Encoder, task) -> list[torch.Tensor]:
        """Per decoder layer, its output at the probe tokens of `task`: [tokens, d] fp32 (CPU)."""
        rows = [encoder.train_example(e.prompt, e.answer) for e in task.test[: self.n_examples]]
        per_layer: list[list[torch.Tensor]] = []
        device = device_of(model)
        with eval_mode(model):
            for start in range(0, len(rows), self.batch_size):
                batch = collate(rows[start:start + self.batch_size], encoder.tokenizer.pad_token_id)
                out = model(input_ids=batch["input_ids"].to(device),
                            attention_mask=batch["attention_mask"].to(device),
                            output_hidden_states=True, use_cache=False,
                            logits_to_keep=1)  # the layers' outputs are wanted, not the vocabulary logits
                keep = batch["attention_mask"].bool().to(device)  # (B, T)
                for layer, hidden in enumerate(out.hidden_states[1:]):  # outputs of layers 0..L-1
                    if len(per_layer) <= layer:
                        per_layer.append([])
                    per_layer[layer].append(hidden[keep].float().cpu())  # (tokens, d)
        feats = [torch.cat(chunks) for chunks in per_layer]
        n = feats[0].shape[0]
        if n > self.max_tokens:
            index = torch.linspace(0, n - 1, self.max_tokens).round().long()
            feats = [f[index] for f in feats]
        return feats

    def after_stage(self, model: nn.Module, encoder: Encoder, tasks: list) -> dict[str, list[float]]:
        """Probe every task in `tasks` (those trained so far). A task seen for the
        first time stores its reference (and gets no entry); the others get CKA
        per layer against their reference."""
        out = {}
        for task in tasks:
            feats = self.features(model, encoder, task)
            ref = self.references.get(task.name)
            if ref is None:
                self.references[task.name] = feats
                continue
            out[task.name] = [round(float(linear_cka(a, b)), 5) for a, b in zip(feats, ref)]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"references": self.references}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.references = dict(state["references"])
