"""`model.tokenizer.token_stream`, the one way text becomes a stream of ids: the trainer and
the model card hand it a `tokenizers.Tokenizer` (batch API), the suite and calibration a
checkpoint's `Tokenizer`; both must give the stream the trainer saw, EOS after each document."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from tenantq.model.tokenizer import Tokenizer, token_stream
from tenantq.reference import reference_model_path

DOCS = ["def f(x):\n    return x + 1\n", "", "import os\nprint(os.sep)\n"]


def test_both_tokenizer_kinds_give_one_stream_with_eos_after_each_document() -> None:
    path = reference_model_path() / "tokenizer.json"
    raw = HFTokenizer.from_file(str(path))
    eos = raw.token_to_id("<|eos|>")
    assert eos is not None  # the reference vocabulary has one
    expected = np.concatenate(
        [np.asarray([*raw.encode(d).ids, eos], np.int32) for d in DOCS]
    )  # fmt: skip
    batch = token_stream(raw, DOCS)
    single = token_stream(Tokenizer(raw), DOCS)
    assert batch.dtype == single.dtype == np.int32
    np.testing.assert_array_equal(batch, expected)
    np.testing.assert_array_equal(single, expected)
    assert int((batch == eos).sum()) == len(DOCS)  # one EOS per document, the empty one too
    assert token_stream(raw, []).shape == (0,) and token_stream(raw, []).dtype == np.int32
