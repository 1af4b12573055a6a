"""Measure the shipped reference checkpoint and write its model card.

Everything is computed from the exported bf16 tensors with bf16 activations (norms and
softmax in float32): test/validation perplexity against a unigram baseline fitted on the
train split, and passkey exact match over a grid of lengths (up to twice the trained
context) and depths spread evenly over 0-100%.
`python -m tenantq.reference.evaluate --model DIR --run RUN_DIR --card`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tenantq.reference import needles, reference_model_path
from tenantq.reference.corpus import load_corpus
from tenantq.reference.export import read_hf_checkpoint
from tenantq.reference.train_model import forward, hidden_states, lm_head

NEEDLE_LENGTHS = (128, 256, 512, 768, 1024, 1536, 2048)
DEPTH_BUCKETS = 5


def split_ids(tokenizer, split: str) -> np.ndarray:
    """A corpus split tokenized as training saw it: files concatenated, EOS after each."""
    eos = tokenizer.token_to_id("<|eos|>")
    enc = tokenizer.encode_batch(load_corpus().texts(split))
    return np.concatenate([np.r_[e.ids, eos] for e in enc]).astype(np.int32)


def unigram_nll(train_ids: np.ndarray, eval_ids: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats/token) of add-one-smoothed train-split token frequencies."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[eval_ids].mean())


def model_nll(params, config, ids: np.ndarray, window: int, dtype, max_windows: int) -> float:
    """Mean next-token NLL over disjoint windows of `window` tokens, each after a BOS."""
    fn = jax.jit(lambda p, x: forward(p, config, x, dtype=dtype))
    total, count = 0.0, 0
    n_windows = min(len(ids) // window, max_windows)
    for b in range(0, n_windows, 4):
        rows = [ids[r * window : (r + 1) * window] for r in range(b, min(b + 4, n_windows))]
        x = np.stack([np.r_[config.bos_token_id, r] for r in rows])
        logits = fn(params, x[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:])
        total, count = total + float(jnp.sum(ce)), count + ce.size
    return total / count


def needle_grid(params, config, tok, source_ids, lengths, count: int, dtype, seed: int = 1234):
    """Exact match per (length, depth bucket); depths evenly spaced over [0, 1].

    Teacher-forced: greedy decoding spells the answer iff the argmax at every answer
    position equals the answer token, so one forward pass scores one needle.
    """

    def answer_argmax(p, x, first):  # argmax only where answer tokens are predicted
        hidden = hidden_states(p, config, x, dtype=dtype)
        span = first[:, None] + jnp.arange(needles.VALUE_DIGITS)[None]
        picked = jnp.take_along_axis(hidden, span[:, :, None], axis=1)
        return jnp.argmax(lm_head(p, config, picked), -1)

    fn = jax.jit(answer_argmax)
    out = {}
    for length in lengths:
        rng = np.random.default_rng([seed, length])
        depths = np.linspace(0.0, 1.0, count)
        hits = np.zeros(count, bool)
        digits_right = np.zeros(count)
        batch = max(1, 4096 // length)
        for start in range(0, count, batch):
            ex = [
                needles.make_needle_example(tok, source_ids, length, float(d), rng)
                for d in depths[start : start + batch]
            ]
            x = np.stack([np.concatenate([p, a]) for p, a in ex])
            first = np.array([len(p) - 1 for p, _ in ex])
            pred = np.asarray(fn(params, x[:, :-1], first))
            for i, (_, a) in enumerate(ex):
                hits[start + i] = needles.needle_correct(pred[i], a)
                digits_right[start + i] = np.mean(pred[i] == a)
        bucket = np.minimum((depths * DEPTH_BUCKETS).astype(int), DEPTH_BUCKETS - 1)
        out[length] = {
            "accuracy": float(hits.mean()),
            "count": count,
            # Teacher-forced share of answer digits right (chance 0.1): partial retrieval.
            "digit_accuracy": float(digits_right.mean()),
            "by_depth": [float(hits[bucket == b].mean()) for b in range(DEPTH_BUCKETS)],
        }
    return out


def evaluate(model_dir, needles_per_length: int = 200, lengths=NEEDLE_LENGTHS, max_windows=400):
    params, config, tok = read_hf_checkpoint(model_dir)
    dtype = jnp.bfloat16
    t0 = time.time()
    ids = {s: split_ids(tok, s) for s in ("train", "valid", "test")}
    window = config.max_position_embeddings
    result = {"dtype": "bfloat16", "eval_window_tokens": window}
    uni_test = unigram_nll(ids["train"], ids["test"], config.vocab_size)
    for split in ("valid", "test"):
        nll = model_nll(params, config, ids[split], window, dtype, max_windows)
        result[f"{split}_nll"] = nll
        result[f"{split}_ppl"] = math.exp(nll)
        result[f"{split}_tokens"] = int(min(len(ids[split]) // window, max_windows) * window)
    result["unigram_test_ppl"] = math.exp(uni_test)
    result["needles"] = needle_grid(
        params, config, tok, ids["test"], lengths, needles_per_length, dtype
    )
    result["eval_wall_s"] = round(time.time() - t0, 1)
    return result


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
        "## Measured quality (bf16 weights and activations)",
        f"- Perplexity over windows of {result['eval_window_tokens']} tokens: validation "
        f"**{result['valid_ppl']:.2f}**, test **{result['test_ppl']:.2f}** "
        f"({result['test_tokens']:,} test tokens); unigram baseline (train-split token "
        f"frequencies) on test: **{result['unigram_test_ppl']:.1f}**.",
        "- Passkey retrieval: greedy exact match of the 5-digit value (`needles.py`; chance",
        "  1e-5), haystacks from the test split, depths evenly spaced over 0-100% (exact match",
        "  per depth fifth); 'digits right' is the teacher-forced share of answer digits",
        "  predicted correctly (chance 10%). Lengths above "
        f"{config['max_position_embeddings']} exceed the trained context:",
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Evaluate the reference checkpoint")
    ap.add_argument("--model", default=str(reference_model_path()))
    ap.add_argument("--needles", type=int, default=200, help="needles per length")
    ap.add_argument("--card", action="store_true", help="write MODEL_CARD.md and eval.json")
    ap.add_argument("--notes", default=None, help="Markdown file appended to the card")
    args = ap.parse_args(argv)
    result = evaluate(args.model, args.needles)
    print(json.dumps(result, indent=1))
    if args.card:
        model_dir = Path(args.model)
        (model_dir / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
        notes = Path(args.notes).read_text() if args.notes else ""
        write_card(model_dir, result, notes)


if __name__ == "__main__":
    main()
