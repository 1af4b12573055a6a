"""Measure the shipped reference checkpoint through the Engine and write its model card.

Every figure comes from `Engine.from_checkpoint(...)`, the path users and the quality suite
run (bf16 weights, activations and KV pool; norms and softmax in float32): perplexity from
`engine.score` over windows that fill the model's context after a BOS, against a unigram
baseline fitted on the train split, and passkey exact match from greedy `engine.generate`
over a grid of prompt lengths and depths spread evenly over 0-100%. The trainer's own
evaluations call the same two loops (`mean_nll`, `needle_grid`) on an in-memory Engine.
`python -m tenantq.reference.evaluate --model DIR --card`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from tenantq.engine import Engine
from tenantq.model.tokenizer import token_stream
from tenantq.reference import needles, reference_model_path
from tenantq.reference.corpus import load_corpus

DEPTH_BUCKETS = 5
# Sequences scored or generated at once (the engine's max_seqs).
EVAL_BATCH = 8


def needle_lengths(context_tokens: int) -> tuple[int, ...]:
    """Prompt lengths of the grid: the engine serves prompt + answer within the context, so
    the longest prompt is the context less the answer's digits."""
    longest = context_tokens - needles.VALUE_DIGITS
    return tuple(n for n in (128, 256, 512, 768) if n < longest) + (longest,)


def split_ids(tokenizer, split: str) -> np.ndarray:
    """A corpus split tokenized as training saw it: files concatenated, EOS after each."""
    return token_stream(tokenizer, load_corpus().texts(split))


def unigram_nll(train_ids: np.ndarray, eval_ids: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats/token) of add-one-smoothed train-split token frequencies."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[eval_ids].mean())


def mean_nll(engine: Engine, ids: np.ndarray, window_tokens: int, max_windows: int) -> float:
    """Mean next-token NLL (nats) of disjoint windows of `ids`, each scored after a BOS.

    `engine.score([BOS], window)`: every window token is predicted from the BOS and the
    window's earlier tokens, so BOS + window must fit the context.
    """
    bos = engine.config.bos_token_id
    n_windows = min(len(ids) // window_tokens, max_windows)
    windows = [ids[r * window_tokens : (r + 1) * window_tokens].tolist() for r in range(n_windows)]
    total, count = 0.0, 0
    for logp in engine.score([[bos]] * n_windows, windows):
        total, count = total - float(np.sum(logp, dtype=np.float64)), count + len(logp)
    return total / max(count, 1)


def needle_grid(engine: Engine, tok, source_ids, lengths, count: int, seed: int = 1234) -> dict:
    """Exact match per prompt length and depth fifth; depths evenly spaced over [0, 1].

    Greedy `engine.generate` of the answer's digit count, no stop token; a needle is
    retrieved when the generated ids equal the answer (`needles.needle_correct`). 'digits
    right' is the share of generated digits equal to the answer's at the same place.
    """
    out = {}
    for length in lengths:
        cells = list(needles.needle_grid(tok, source_ids, (length,), count, (seed,)))
        depths = np.array([c.example.depth_fraction for c in cells])
        examples = [(c.example.prompt_ids, c.example.answer_ids) for c in cells]
        generated = engine.generate(
            [p.tolist() for p, _ in examples], needles.VALUE_DIGITS, stop_tokens=[]
        )
        hits = np.array(
            [
                needles.needle_correct(np.array(g), a)
                for g, (_, a) in zip(generated, examples, strict=True)
            ]
        )
        digits = np.array(
            [
                np.mean(np.array(g[: len(a)]) == a)
                for g, (_, a) in zip(generated, examples, strict=True)
            ]
        )
        bucket = np.minimum((depths * DEPTH_BUCKETS).astype(int), DEPTH_BUCKETS - 1)
        out[length] = {
            "accuracy": float(hits.mean()),
            "count": count,
            "digit_accuracy": float(digits.mean()),
            "by_depth": [float(hits[bucket == b].mean()) for b in range(DEPTH_BUCKETS)],
        }
    return out


def evaluate(model_dir, needles_per_length: int = 200, lengths=None, max_windows=400) -> dict:
    model_dir = Path(model_dir)
    engine = Engine.from_checkpoint(model_dir, dtype="bfloat16", max_seqs=EVAL_BATCH)
    config, tok = engine.config, _raw_tokenizer(model_dir)
    context = config.max_position_embeddings
    lengths = needle_lengths(context) if lengths is None else tuple(lengths)
    t0 = time.time()
    ids = {s: split_ids(tok, s) for s in ("train", "valid", "test")}
    window = context - 1  # BOS + window fills the context
    result = {
        "path": "Engine.from_checkpoint(dtype='bfloat16'): score() and greedy generate()",
        "dtype": "bfloat16",
        "eval_window_tokens": window,
    }
    uni_test = unigram_nll(ids["train"], ids["test"], config.vocab_size)
    for split in ("valid", "test"):
        nll = mean_nll(engine, ids[split], window, max_windows)
        result[f"{split}_nll"] = nll
        result[f"{split}_ppl"] = math.exp(nll)
        result[f"{split}_tokens"] = int(min(len(ids[split]) // window, max_windows) * window)
    result["unigram_test_ppl"] = math.exp(uni_test)
    result["needles"] = needle_grid(engine, tok, ids["test"], lengths, needles_per_length)
    result["eval_wall_s"] = round(time.time() - t0, 1)
    return result


def _raw_tokenizer(model_dir: Path):
    """The `tokenizers.Tokenizer` itself: needles and corpus splits use its batch API."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def write_card(model_dir: Path, result: dict, notes: str = "") -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    training = json.loads((model_dir / "training.json").read_text())
    corpus = training["corpus"]
    lines = [
        "# tenantq reference model (Python stdlib, 4-layer Llama)",
        "",
        "A small Llama-architecture model trained on this machine from scratch by",
        "`python -m tenantq.reference.train`, shipped so tenantq's default run and tests have a",
        "real trained checkpoint whose quality quantization can damage measurably. It is not a",
        "useful code model; it exists to be measured.",
        "",
        "## Corpus and split",
        f"- Python {corpus['python']} standard library `.py` files (`sysconfig` stdlib path), "
        f"excluding folders {', '.join(corpus['excluded_dirs'])}.",
        f"- Split by file: {corpus['split_rule']}.",
    ]
    for split, info in corpus["splits"].items():
        lines.append(
            f"- {split}: {info['files']} files, file-list sha256 `{info['file_list_sha256']}`"
        )
    lines += [
        "- Another Python patch release has a slightly different stdlib; the split rule (not",
        "  the hashes) is what evaluation applies, so figures there differ a little.",
        "",
        "## Tokenizer",
        f"Byte-level BPE (`tokenizers`), vocabulary {config['vocab_size']}, trained on the train",
        "split only; digits are pre-split one per token; special tokens `<|pad|>`=0,",
        "`<|bos|>`=1, `<|eos|>`=2. Saved as `tokenizer.json`.",
        "",
        "## Architecture",
        f"Llama: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"MLP {config['intermediate_size']} (SwiGLU), {config['num_attention_heads']} query "
        f"heads and {config['num_key_value_heads']} KV heads (grouped-query) of "
        f"{config['head_dim']}, RoPE theta {config['rope_theta']:g}, RMSNorm eps "
        f"{config['rms_norm_eps']}, untied LM head, context "
        f"{config['max_position_embeddings']} tokens; {training['parameters']:,} parameters, "
        "stored in bf16 (`model.safetensors`).",
        "",
        "## Training",
        f"- {training['recipe']}",
        f"- Steps: {training['steps']:,}; tokens seen: {training['tokens_seen']:,}; "
        f"wall time {training['wall_s'] / 3600:.2f} h on 2 shared CPU cores "
        f"(plain JAX, float32), about {training['tokens_per_s']:.0f} tokens/s on average.",
        f"- Optimizer: {training['optimizer']}.",
        "",
        "## Measured quality (bf16 weights, activations and KV cache)",
        f"Measured through the engine users run: {result['path']} "
        f"(`python -m tenantq.reference.evaluate --card`, {result['eval_wall_s']:.0f} s).",
        "",
        f"- Perplexity over windows of {result['eval_window_tokens']} tokens, each after a BOS "
        "(together the model's context): validation "
        f"**{result['valid_ppl']:.2f}**, test **{result['test_ppl']:.2f}** "
        f"({result['test_tokens']:,} test tokens); unigram baseline (train-split token "
        f"frequencies) on test: **{result['unigram_test_ppl']:.1f}**.",
        "- Passkey retrieval: greedy exact match of the 5-digit value (`needles.py`; chance",
        "  1e-5), haystacks from the test split, depths evenly spaced over 0-100% (exact match",
        "  per depth fifth); 'digits right' is the share of greedily generated digits equal to",
        "  the answer's digit at the same place (chance 10%). The longest prompt is the context",
        f"  ({config['max_position_embeddings']}) less the 5 answer tokens: the engine refuses",
        "  sequences beyond the context.",
        "",
        "| prompt tokens | needles | exact match | digits right | depth 0-20% | 20-40% | 40-60%"
        " | 60-80% | 80-100% |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length, r in result["needles"].items():
        depth = " | ".join(f"{a:.0%}" for a in r["by_depth"])
        lines.append(
            f"| {length} | {r['count']} | **{r['accuracy']:.1%}** | {r['digit_accuracy']:.1%} "
            f"| {depth} |"
        )
    lines += ["", notes.strip(), ""] if notes.strip() else [""]
    path = model_dir / "MODEL_CARD.md"
    path.write_text("\n".join(lines))
    return path


def existing_notes(card_text: str) -> str:
    """The free-text notes of a card: everything after its last table row."""
    lines = card_text.splitlines()
    last_row = max((i for i, line in enumerate(lines) if line.startswith("|")), default=-1)
    return "\n".join(lines[last_row + 1 :]).strip()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Evaluate the reference checkpoint")
    ap.add_argument("--model", default=str(reference_model_path()))
    ap.add_argument("--needles", type=int, default=200, help="needles per length")
    ap.add_argument(
        "--max-windows", type=int, default=400, help="perplexity windows per split, at most"
    )
    ap.add_argument("--card", action="store_true", help="write MODEL_CARD.md and eval.json")
    ap.add_argument(
        "--notes",
        default=None,
        help="Markdown file appended to the card (default: keep the "
        "notes of the card being replaced)",
    )
    args = ap.parse_args(argv)
    result = evaluate(args.model, args.needles, max_windows=args.max_windows)
    print(json.dumps(result, indent=1))
    if args.card:
        model_dir = Path(args.model)
        (model_dir / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
        card = model_dir / "MODEL_CARD.md"
        if args.notes:
            notes = Path(args.notes).read_text()
        else:  # keep the notes of the card being replaced
            notes = existing_notes(card.read_text()) if card.is_file() else ""
        write_card(model_dir, result, notes)


if __name__ == "__main__":
    main()
