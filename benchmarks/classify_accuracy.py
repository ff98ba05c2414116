"""Classification accuracy per label-scoring method, against gold labels.

Every method scores the four topic labels for each document of
``benchmarks/data/topics.jsonl`` (240 hand-written news snippets, 60 each of
sports, politics, science and business) through jaxserve: the label prompt
module the worker uses (:mod:`jaxserve.tokenizer.labels`), the engine's score
requests, and :func:`jaxserve.engine.scoring.combine` with the calibration
offsets the worker would subtract. Methods:

* ``plain``: a continuation of "... The topic of this article (sports,
  politics, science or business) is:" with the label right after the colon
  (what ``jaxserve batch --labels`` did before the chat form);
  ``plain-space``: the same prompt ending in a space, so each label is
  scored as " sports" (the space merges into the label's first token);
* ``chat``: the instruction and the document as one user message in the
  model's chat template, each label scored as the assistant's answer;
  ``chat-B``/``chat-C``: other instruction wordings; ``chat-Cap``:
  capitalized labels; ``chat-mean``/``chat-first``: normalizations;
* ``calibrated``: ``chat`` minus each label's score on the same prompt with
  the document replaced by "N/A" (Zhao et al. 2021);
  ``plain-calibrated`` likewise for ``plain-space``;
* ``few-shot``: ``chat`` after eight worked examples (two per class, from
  ``benchmarks/data/topics_fewshot.jsonl``, not in the evaluation set) as
  prior turns; ``few-shot-calibrated``;
* ``batch-calibrated``: ``calibrated`` with each label's mean
  log-probability over the documents taken off before the pick, as
  ``jaxserve batch`` does to its output after a run
  (:mod:`jaxserve.batch.calibration`; the content-free offsets cancel out
  under it); ``few-shot-batch-calibrated``.

To avoid picking a method on the data it is reported on, the documents are
split into halves (alternate documents of each class): the method with the
best accuracy on half A is named, and each method's accuracy is reported on
A, B and the whole set. ``jaxserve batch --labels`` uses the CLI's default
method (:data:`jaxserve.cli.batch_command.DEFAULT_LABEL_PROMPT` /
``DEFAULT_CALIBRATE``), reported as ``default``.

With ``--hf-check N`` the label log-likelihoods of N documents (every
method's prompts, and the content-free ones) are computed again by
transformers reading the same GGUF file, on the same token ids; the largest
absolute difference is reported, and transformers' own tokenization of each
rendered prompt + label is checked to be the same ids.

    python benchmarks/classify_accuracy.py --model smollm2-135m --hf-check 8

Writes ``benchmarks/results/classify-accuracy-<UTC>.json`` and the default
method's confusion matrix (``docs/img/classify-confusion.png``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxserve.batch import calibration as batch_calibration  # noqa: E402
from jaxserve.engine import scoring  # noqa: E402
from jaxserve.tokenizer import labels as L  # noqa: E402

CLASSES = ("sports", "politics", "science", "business")
INSTRUCTIONS = {
    "A": "What is the topic of this news article? Answer with one word: sports, politics, science or business.\n\n{text}",
    "B": "Article: {text}\n\nIs this article about sports, politics, science or business?",
    "C": "Classify the following news article into one of these categories: sports, politics, science, business.\n\nArticle: {text}\n\nCategory:",
}
PLAIN = "Article: {text}\nThe topic of this article (sports, politics, science or business) is:"


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    form: str  # plain | chat
    template: str
    labels: tuple[str, ...] = CLASSES
    calibrate: bool = False
    few_shot: bool = False
    normalization: str = "sum"
    batch: bool = False  # batch calibration over the documents (jaxserve.batch.calibration)


METHODS = [
    Method("plain", "plain", PLAIN),
    Method("plain-space", "plain", PLAIN + " "),
    Method("plain-calibrated", "plain", PLAIN + " ", calibrate=True),
    Method("chat", "chat", INSTRUCTIONS["A"]),
    Method("chat-B", "chat", INSTRUCTIONS["B"]),
    Method("chat-C", "chat", INSTRUCTIONS["C"]),
    Method("chat-Cap", "chat", INSTRUCTIONS["A"], labels=tuple(c.capitalize() for c in CLASSES)),
    Method("chat-mean", "chat", INSTRUCTIONS["A"], normalization="mean"),
    Method("chat-first", "chat", INSTRUCTIONS["A"], normalization="first"),
    Method("calibrated", "chat", INSTRUCTIONS["A"], calibrate=True),
    Method("few-shot", "chat", INSTRUCTIONS["A"], few_shot=True),
    Method("few-shot-calibrated", "chat", INSTRUCTIONS["A"], calibrate=True, few_shot=True),
    Method("batch-calibrated", "chat", INSTRUCTIONS["A"], calibrate=True, batch=True),
    Method("few-shot-batch-calibrated", "chat", INSTRUCTIONS["A"], calibrate=True, few_shot=True, batch=True),
]


def default_method_name() -> str:
    """The method ``jaxserve batch --labels`` uses by default (with the README's template)."""
    from jaxserve.cli.batch_command import DEFAULT_BATCH_CALIBRATION, DEFAULT_CALIBRATE, DEFAULT_LABEL_PROMPT

    if DEFAULT_LABEL_PROMPT == "chat":
        if DEFAULT_BATCH_CALIBRATION:  # content-free calibration cancels out under it
            return "batch-calibrated"
        return "calibrated" if DEFAULT_CALIBRATE else "chat"
    return "plain-calibrated" if DEFAULT_CALIBRATE else "plain-space"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def request_for(m: Method, text: str, shots: list[dict]) -> L.LabelRequest:
    few = (
        tuple(L.FewShot(m.template.format(text=s["text"]), m.labels[CLASSES.index(s["label"])]) for s in shots)
        if m.few_shot
        else ()
    )
    return L.LabelRequest(
        labels=m.labels,
        prompt=m.template.format(text=text),
        form=m.form,
        few_shot=few,
        first_token_only=m.normalization == "first",
    )


def content_free(m: Method, shots: list[dict]) -> L.LabelRequest:
    # the template filled with N/A: the instruction kept, the document gone (what the CLI sends)
    return dataclasses.replace(request_for(m, "N/A", shots))


def run_engine(engine, jobs: dict[str, L.LabelTokens], window: int = 64) -> dict[str, list[float]]:
    """Every score request through the engine, at most ``window`` in flight
    (the engine batches them), and each distinct prompt + labels once (the
    calibrated methods score the same documents as their plain siblings)."""
    unique: dict[str, L.LabelTokens] = {}
    for t in jobs.values():
        unique.setdefault(t.identity(), t)
    todo = list(unique.items())
    done: dict[str, list[float]] = {}
    t0 = time.time()
    while todo or engine.has_unfinished():
        while todo and (len(unique) - len(todo)) - len(done) < window:
            ident, t = todo.pop(0)
            engine.add_score_request(ident, t.prompt_ids, t.label_ids)
        for out in engine.step():
            if out.finished:
                if out.error is not None:
                    raise RuntimeError(f"{out.request_id}: {out.error}")
                done[out.request_id] = list(out.label_logprobs)
                if len(done) % 100 == 0:
                    print(f"  {len(done)}/{len(unique)} scored, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return {rid: done[t.identity()] for rid, t in jobs.items()}


def hf_check(
    model_path: str,
    tok,
    jobs: dict[str, L.LabelTokens],
    texts: dict[str, tuple[str, bool, tuple[str, ...]]],
    ours: dict[str, list[float]],
) -> dict:
    """transformers on the same token ids: max |ours - theirs| over every
    label of every request; and whether transformers' tokenizer writes the
    same ids for each rendered prompt + label."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(model_path)
    if path.suffix != ".gguf":  # a preset naming a GGUF file inside a package
        spec = json.loads((ROOT / "models" / f"{model_path}.json").read_text())["gguf"]
        path = Path(importlib.util.find_spec(spec["package"]).submodule_search_locations[0]) / spec["file"]
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    worst, same_ids, n = 0.0, 0, 0
    for rid, t in jobs.items():
        text, specials, labels = texts[rid]
        with torch.no_grad():  # the prompt once: single-token labels read its last position
            last = torch.log_softmax(hf(torch.tensor([t.prompt_ids])).logits[0, -1].double(), -1)
        for k, ids in enumerate(t.label_ids):
            full = t.prompt_ids + ids
            if len(ids) == 1:
                theirs = float(last[ids[0]])
            else:
                with torch.no_grad():
                    lp = torch.log_softmax(hf(torch.tensor([full])).logits[0].double(), -1)
                theirs = sum(float(lp[len(t.prompt_ids) - 1 + j, tok_id]) for j, tok_id in enumerate(ids))
            worst = max(worst, abs(theirs - ours[rid][k]))
            n += 1
            hf_ids = hf_tok(text + labels[k], add_special_tokens=specials).input_ids
            same_ids += int(hf_ids[: len(full)] == full)  # ('first' keeps the label's first token only)
    return {"labels_compared": n, "max_abs_diff": worst, "hf_tokenization_same_ids": same_ids}


def confusion(gold: list[str], pred: list[str]) -> list[list[int]]:
    m = [[0] * len(CLASSES) for _ in CLASSES]
    for g, p in zip(gold, pred):
        m[CLASSES.index(g)][CLASSES.index(p)] += 1
    return m


def plot_confusion(matrix: list[list[int]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4.6), dpi=120)
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(len(CLASSES)), CLASSES)
    ax.set_yticks(range(len(CLASSES)), CLASSES)
    ax.set_xlabel("predicted")
    ax.set_ylabel("gold")
    top = max(max(r) for r in matrix)
    for i, row in enumerate(matrix):
        for j, v in enumerate(row):
            ax.text(j, i, str(v), ha="center", va="center", color="white" if v > top / 2 else "black")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default=str(ROOT / "benchmarks/data/topics.jsonl"))
    ap.add_argument("--few-shot", default=str(ROOT / "benchmarks/data/topics_fewshot.jsonl"))
    ap.add_argument("--methods", default=",".join(m.name for m in METHODS), help="comma-separated subset")
    ap.add_argument("--limit", type=int, default=None, help="only the first N documents")
    ap.add_argument(
        "--hf-check", type=int, default=8, metavar="N", help="documents compared with transformers (0: none)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument(
        "--quantization", choices=["int8", "int4"], default=None, help="weights as --quantization loads them"
    )
    ap.add_argument(
        "--out", default=None, help="results JSON (default benchmarks/results/classify-accuracy-<UTC>.json)"
    )
    ap.add_argument("--plot", default=str(ROOT / "docs/img/classify-confusion.png"))
    args = ap.parse_args()

    from jaxserve.engine.llm import LLM

    docs = read_jsonl(Path(args.data))[: args.limit]
    shots = read_jsonl(Path(args.few_shot))
    overlap = {d["text"] for d in docs} & {s["text"] for s in shots}
    assert not overlap, f"few-shot examples in the evaluation set: {overlap}"
    wanted = args.methods.split(",")
    methods = [m for m in METHODS if m.name in wanted]
    t0 = time.time()
    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        enable_prefix_caching=True,
        quantization=args.quantization,
    )
    tok = llm.engine.tokenizer
    load_s = time.time() - t0
    jobs: dict[str, L.LabelTokens] = {}
    texts: dict[str, tuple[str, bool, tuple[str, ...]]] = {}
    for m in methods:
        reqs = [("cf", content_free(m, shots))] if m.calibrate else []
        reqs += [(d["id"], request_for(m, d["text"], shots)) for d in docs]
        for key, req in reqs:
            rid = f"{m.name}|{key}"
            jobs[rid] = L.prepare(tok, req)
            text, specials = L.render(tok, req)
            texts[rid] = (text, specials, req.labels)
    t1 = time.time()
    scores = run_engine(llm.engine, jobs)
    score_s = time.time() - t1
    gold = [d["label"] for d in docs]
    half = {
        "A": [i for i in range(len(docs)) if _half(docs, i) == "A"],
        "B": [i for i in range(len(docs)) if _half(docs, i) == "B"],
    }
    results: dict[str, dict] = {}
    for m in methods:
        offsets = None
        if m.calibrate:
            cf = jobs[f"{m.name}|cf"]
            offsets = scoring.normalize(scores[f"{m.name}|cf"], [len(x) for x in cf.label_ids], m.normalization)
        rows = []
        for d in docs:
            rid = f"{m.name}|{d['id']}"
            rows.append(
                scoring.combine(m.labels, scores[rid], [len(x) for x in jobs[rid].label_ids], m.normalization, offsets)
            )
        if m.batch:  # what jaxserve batch does to its output file after the run
            logprobs = [[x.logprob for x in row] for row in rows]
            offs = batch_calibration.offsets(logprobs)
            picks = [m.labels[batch_calibration.calibrated(lp, offs)[0]] for lp in logprobs]
        else:
            picks = [scoring.best(row).label for row in rows]
        preds = [CLASSES[m.labels.index(p)] for p in picks]
        acc = {k: sum(preds[i] == gold[i] for i in idx) / max(1, len(idx)) for k, idx in half.items()}
        acc["all"] = sum(p == g for p, g in zip(preds, gold)) / len(docs)
        results[m.name] = {
            "accuracy": acc,
            "correct": sum(p == g for p, g in zip(preds, gold)),
            "n": len(docs),
            "predicted_counts": {c: preds.count(c) for c in CLASSES},
            "confusion": confusion(gold, preds),
            "label_tokens": [len(x) for x in jobs[f"{m.name}|{docs[0]['id']}"].label_ids],
            "method": dataclasses.asdict(m),
        }
    best_on_a = max(results, key=lambda k: results[k]["accuracy"]["A"])
    default = default_method_name()
    check = None
    if args.hf_check:
        sample = {d["id"] for d in docs[: args.hf_check]} | {"cf"}
        sub = {rid: t for rid, t in jobs.items() if rid.split("|", 1)[1] in sample}
        check = hf_check(args.model, tok, sub, texts, scores)
    print(f"{'method':22s} {'half A':>7s} {'half B':>7s} {'all':>7s}   predicted (sports/politics/science/business)")
    for name, r in results.items():
        a = r["accuracy"]
        mark = " <- default" if name == default else ""
        print(f"{name:22s} {a['A']:7.1%} {a['B']:7.1%} {a['all']:7.1%}   {list(r['predicted_counts'].values())}{mark}")
    print(f"best on half A: {best_on_a}; default method: {default}")
    if check:
        print(
            f"transformers on the same token ids ({check['labels_compared']} labels): max |diff| {check['max_abs_diff']:.2e}; "
            f"its own tokenization gives the same ids for {check['hf_tokenization_same_ids']} of them"
        )
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%M%SZ")
    out = Path(args.out) if args.out else ROOT / "benchmarks/results" / f"classify-accuracy-{stamp}.json"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    report = {
        "command": "python " + " ".join(sys.argv),
        "commit": commit,
        "utc": stamp,
        "model": args.model,
        "quantization": args.quantization,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "data": os.path.relpath(args.data, ROOT),
        "documents": len(docs),
        "halves": {k: len(v) for k, v in half.items()},
        "default_method": default,
        "best_on_half_A": best_on_a,
        "methods": results,
        "hf_check": check,
        "seconds": {"load": round(load_s, 1), "scoring": round(score_s, 1), "score_requests": len(jobs)},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    if default in results:
        r = results[default]
        plot_confusion(
            r["confusion"],
            f"{args.model}, method '{default}': {r['correct']}/{r['n']} = {r['accuracy']['all']:.1%}",
            Path(args.plot),
        )
        print(f"wrote {out} and {args.plot}")
    else:
        print(f"wrote {out}")


def _half(docs: list[dict], i: int) -> str:
    """Alternate documents of each class: half A, half B."""
    label = docs[i]["label"]
    k = sum(1 for d in docs[:i] if d["label"] == label)
    return "A" if k % 2 == 0 else "B"


if __name__ == "__main__":
    main()
