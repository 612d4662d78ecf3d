"""SARI (Xu et al., 2016, "Optimizing Statistical Machine Translation for Text
Simplification", TACL 4:401-415), with the conventions of HF `evaluate`'s `sari`
metric, which TRACE scores 20Minuten with, and of tensor2tensor's `sari_hook`:

    SARI = (F_keep + P_del + F_add) / 3

Each term is averaged over n-gram orders n = 1..4. Two conventions differ from
the authors' original script: 0/0 counts as 1, and keep recall divides by the
total count of n-grams kept in the references (cocoxu/simplification issue #6).

Counting, for one order n, with k = the number of references:
  S, C  the source and prediction n-gram counts, each multiplied by k;
  R     the n-gram counts summed over the references (so R[g] / k is the
        fraction of references that keep g when g occurs once).
  keep: K = S & C (min).
        P = mean over g in K of min(K[g], R[g]) / K[g];
        recall = sum_g min(K[g], R[g]) / sum_g min(S[g], R[g]).
  del:  D = S - C (positive part).
        P = mean over g in D of max(D[g] - R[g], 0) / D[g]   (precision only).
  add:  sets only. A = set(C) - set(S).
        P = |A & set(R)| / |A|;  recall = |A & set(R)| / |set(R) - set(S)|.
  F = 2PR / (P + R), or 0 when P = R = 0.

Text is lower-cased and run through sacrebleu's '13a' tokenizer, as HF does,
then split on single spaces. An empty string therefore gives one empty token,
as in HF.
"""

from collections import Counter

from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

MAX_ORDER = 4
_TOKENIZE_13A = Tokenizer13a()


def normalize(text: str) -> list[str]:
    """Lower-case, apply sacrebleu's 13a tokenizer, split on single spaces.

    `str.split(" ")` (not `split()`) matches HF: "" becomes [""], one empty token.
    """
    return _TOKENIZE_13A(text.lower()).split(" ")


def _ngram_counts(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _f1(precision: float, recall: float) -> float:
    if precision + recall == 0:
        return 0.0
    return 2 * precision * recall / (precision + recall)


def _scale(counts: Counter, k: int) -> Counter:
    return Counter({g: c * k for g, c in counts.items()})


def _order_scores(
    source: list[str], prediction: list[str], references: list[list[str]], n: int
) -> tuple[float, float, float]:
    """(F_keep, P_del, F_add) for n-grams of order n."""
    k = len(references)
    s = _scale(_ngram_counts(source, n), k)
    c = _scale(_ngram_counts(prediction, n), k)
    r = Counter()
    for ref in references:
        r.update(_ngram_counts(ref, n))

    kept = s & c
    kept_good = kept & r
    kept_all = s & r
    keep_p = sum(kept_good[g] / kept[g] for g in kept) / len(kept) if kept else 1.0
    keep_r = sum(kept_good.values()) / sum(kept_all.values()) if kept_all else 1.0

    deleted = s - c
    deleted_good = deleted - r
    del_p = (
        sum(deleted_good[g] / deleted[g] for g in deleted) / len(deleted)
        if deleted
        else 1.0
    )

    added = set(c) - set(s)
    added_good = added & set(r)
    added_all = set(r) - set(s)
    add_p = len(added_good) / len(added) if added else 1.0
    add_r = len(added_good) / len(added_all) if added_all else 1.0

    return _f1(keep_p, keep_r), del_p, _f1(add_p, add_r)


def sentence_sari(source: str, prediction: str, references: list[str]) -> float:
    """SARI of one prediction against one or more references, on 0-1.

    Raises ValueError when `references` is empty.
    """
    if not references:
        raise ValueError("sentence_sari needs at least one reference")
    src = normalize(source)
    pred = normalize(prediction)
    refs = [normalize(r) for r in references]
    keep = delete = add = 0.0
    for n in range(1, MAX_ORDER + 1):
        k, d, a = _order_scores(src, pred, refs, n)
        keep, delete, add = keep + k, delete + d, add + a
    return (keep + delete + add) / (3 * MAX_ORDER)


def corpus_sari(
    sources: list[str], predictions: list[str], references: list[list[str]]
) -> float:
    """Mean sentence SARI over items, x100, which is what HF `evaluate`'s `sari`
    returns: its `_compute` sums `SARIsent` over items, divides by the number of
    predictions and multiplies by 100.

    Raises ValueError on empty input or mismatched lengths.
    """
    if not (len(sources) == len(predictions) == len(references)):
        raise ValueError(
            f"corpus_sari: lengths differ: {len(sources)} sources, "
            f"{len(predictions)} predictions, {len(references)} reference lists"
        )
    if not predictions:
        raise ValueError("corpus_sari: no items to score")
    total = sum(
        sentence_sari(s, p, refs) for s, p, refs in zip(sources, predictions, references)
    )
    return 100 * total / len(predictions)
