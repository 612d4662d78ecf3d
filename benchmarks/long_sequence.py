"""The long-sequence benchmark: fifteen text-classification tasks (Razdaibiedina
et al., Progressive Prompts, ICLR 2023; O-LoRA, Wang et al., EMNLP 2023), in the
layout of O-LoRA's release (github.com/cmnfriend/O-LoRA, `CL_Benchmark/`):
`<Task>/{train,test}.json`, a JSON list of {"label", "sentence"}, and
`<Task>/labels.json`, the label strings; the release nests tasks in a family
folder (`NLI/CB/`), a flattened copy has them at the top (`CB/`): both are read.

Prompts are built as the release builds them (its src/uie_dataset_lora.py and
src/uie_collator.py, run with --add_task_name and --add_dataset_name as its
scripts/long.sh does): "Task:<family>\\nDataset:<task>\\n" + the family's
instruction + "Option: " + the labels of labels.json joined by ", " + " \\n" +
the sentence + "\\nAnswer:"; COPA has no instruction and no option line. The
answer is the label; it scores by exact match after O-LoRA's normalisation
(metric exact_match, cl_bench/metrics/scorers.py). Each task's answer form is its
label set (cl_bench/metrics/answer_form.py, label): a prediction that is one of
LABELS' strings once normalised so has the form, whatever its content.

Splits: `test` is test.json (the release's dev.json is a copy of it). There is
no held-out split for model selection, so `eval` is carved from train.json: a
tenth of it (at least one item), the first of one shuffle keyed by the task's
name only (the same for every seed and run); `train` is the rest. Both name
train.json in a run's provenance, with indices into it (docs/benchmarks.md).
"""
from __future__ import annotations

import json
from pathlib import Path

from cl_bench.benchmark import Benchmark, Example, TaskSpec, read_checked, seeded_order
from cl_bench.errors import UserError
from cl_bench.metrics.answer_form import label
from cl_bench.registry import register_benchmark

# Facts from O-LoRA's repository at commit 07117e1 (github.com/cmnfriend/O-LoRA):
# each task's family is the key its configs/long_configs/<task>/*_tasks.json lists it under;
# the instructions are configs/instruction_config.json's (COPA has none there);
# the labels are CL_Benchmark/<family>/<task>/labels.json's, in their order.
FAMILY = {"MNLI": "NLI", "CB": "NLI", "RTE": "NLI", "QQP": "QQP", "SST-2": "SC", "amazon": "SC", "yelp": "SC",
          "IMDB": "SC", "agnews": "TC", "dbpedia": "TC", "yahoo": "TC", "BoolQA": "BoolQA", "MultiRC": "MultiRC",
          "WiC": "WiC", "COPA": "COPA"}
INSTRUCTIONS = {
    "NLI": 'What is the logical relationship between the "sentence 1" and the "sentence 2"? '
           'Choose one from the option.\n',
    "QQP": 'Whether the "first sentence" and the "second sentence" have the same meaning? '
           'Choose one from the option.\n',
    "SC": "What is the sentiment of the following paragraph? Choose one from the option.\n",
    "TC": "What is the topic of the following paragraph? Choose one from the option.\n",
    "BoolQA": "According to the following passage, is the question true or false? Choose one from the option.\n",
    "MultiRC": "According to the following passage and question, is the candidate answer true or false? "
               "Choose one from the option.\n",
    "WiC": "Given a word and two sentences, whether the word is used with the same sense in both sentence? "
           "Choose one from the option.\n",
}
LABELS = {
    "MNLI": ("neutral", "entailment", "contradiction"), "CB": ("entailment", "contradiction", "neutral"),
    "RTE": ("contradiction", "entailment"), "QQP": ("False", "True"), "SST-2": ("Good", "Bad"),
    "IMDB": ("Good", "Bad"), "amazon": ("very negative", "negative", "neutral", "positive", "very positive"),
    "yelp": ("very negative", "negative", "neutral", "positive", "very positive"),
    "agnews": ("World", "Sports", "Business", "Science or Technology"),
    "dbpedia": ("Company", "Educational Institution", "Artist", "Athlete", "Office Holder", "Mean of Transportation",
                "Building", "Natural Place", "Village", "Animal", "Plant", "Album", "Film", "Written Work"),
    "yahoo": ("Society & Culture", "Science & Mathematics", "Health", "Education & Reference",
              "Computers & Internet", "Sports", "Business & Finance", "Entertainment & Music",
              "Family & Relationships", "Politics & Government"),
    "BoolQA": ("True", "False"), "MultiRC": ("False", "True"), "WiC": ("True", "False"), "COPA": ("A", "B"),
}
# Orders 4, 5 and 6 over the fifteen tasks, as Progressive Prompts and O-LoRA number them (the
# papers' task-order tables). O-LoRA's repository at 07117e1 trains one of them, order 6, in
# scripts/long.sh (its --task_config_dir sequence, checked); orders 4 and 5 are not in its scripts,
# and are the papers' lists, as later O-LoRA-based scripts spell them too (datasets[4], datasets[5]).
ORDERS = {
    "order4": ["MNLI", "CB", "WiC", "COPA", "QQP", "BoolQA", "RTE", "IMDB", "yelp", "amazon", "SST-2", "dbpedia",
               "agnews", "MultiRC", "yahoo"],
    "order5": ["MultiRC", "BoolQA", "WiC", "MNLI", "CB", "COPA", "QQP", "RTE", "IMDB", "SST-2", "dbpedia", "agnews",
               "yelp", "amazon", "yahoo"],
    "order6": ["yelp", "amazon", "MNLI", "CB", "COPA", "QQP", "RTE", "IMDB", "SST-2", "dbpedia", "agnews", "yahoo",
               "MultiRC", "BoolQA", "WiC"],
}
# Order 4 without the five tasks the 10-task copy (../shared/long-sequence) lacks: what `cpu` runs.
MISSING_HERE = ("yelp", "IMDB", "MultiRC", "dbpedia", "yahoo")
ORDERS["order4-10"] = [t for t in ORDERS["order4"] if t not in MISSING_HERE]

# Every label is at most 5 tokens ("Mean of Transportation"); 8 leave room for EOS and a space.
MAX_NEW_TOKENS = 8
EVAL_SHARE = 10  # eval is 1/EVAL_SHARE of train.json

# The cpu profile, sized by the rule in docs/benchmarks.md ("The cpu profile of long-sequence"):
# answers are one short label, so items go to the test side: 200 test items a task (CB: its 56).
CPU = {"data": {"order": "order4-10", "n_train": 128, "n_test": 200}, "eval": {"max_new_tokens_cap": 8}}
PROFILES = {"smoke": {"data": {"order": ["CB", "COPA"]}}, "cpu": CPU, "cpu-long": CPU,
            "paper": {"data": {"order": "order4"}}}


def prompt(task: str, labels: list[str], sentence: str) -> str:
    """The release's prompt for one item (module docstring)."""
    family = FAMILY[task]
    head = f"Task:{family}\nDataset:{task}\n"
    if family not in INSTRUCTIONS:  # COPA: its sentence holds the question and the options
        return f"{head}{sentence}\nAnswer:"
    return f"{head}{INSTRUCTIONS[family]}Option: {', '.join(labels)} \n{sentence}\nAnswer:"


class LongSequence(Benchmark):
    def task_dir(self, data_dir: Path, task: str) -> Path:
        flat = Path(data_dir) / task
        return flat if flat.is_dir() or task not in FAMILY else Path(data_dir) / FAMILY[task] / task

    def read_split(self, data_dir: Path, task: str, split: str) -> tuple[list[Example], Path]:
        path = self.split_file(data_dir, task, "train" if split == "eval" else split)
        labels = _labels(self.task_dir(data_dir, task) / "labels.json")
        examples = [Example(prompt(task, labels, r["sentence"]), r["label"], i)
                    for i, r in enumerate(read_checked(path, ("sentence", "label")))]
        if split == "test":
            return examples, path
        order = seeded_order(len(examples), f"cl-bench/{self.name}/eval/{task}")
        held_out = set(order[:max(1, len(examples) // EVAL_SHARE)])
        return [e for e in examples if (e.index in held_out) == (split == "eval")], path


def _labels(path: Path) -> list[str]:
    try:
        labels = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: missing; the release has a labels.json (the label strings) in every task "
                        f"folder; copy it from there") from None
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path}: not a UTF-8 JSON list of label strings; copy it from the release") from None
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
        raise UserError(f"{path}: expected a JSON list of label strings; copy it from the release")
    return labels


TASKS = {t: TaskSpec(name=t, metric="exact_match", max_new_tokens=MAX_NEW_TOKENS, language="en",
                     description=f"{FAMILY[t]} task {t} from O-LoRA's release; exact match of the label.",
                     labels=LABELS[t])
         for t in ORDERS["order4"]}

LONG_SEQUENCE = register_benchmark(LongSequence(
    name="long-sequence", title="long-sequence",
    description="the long sequence of Progressive Prompts and O-LoRA (orders 4-6): text classification; "
                "exact match of the label",
    tasks=TASKS, orders=ORDERS, default_order="order4", profiles=PROFILES,
    answer_forms={t: label(spec.labels, spec.metric) for t, spec in TASKS.items()},
    default_dirs=("data/long-sequence", "../shared/long-sequence"),
    reference="O-LoRA (github.com/cmnfriend/O-LoRA @07117e1); Razdaibiedina et al., ICLR 2023",
))
