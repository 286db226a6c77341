"""Batch jobs to and from object storage, against real local servers (the GCS emulator through
gcsfs, moto's S3 server through s3fs): a job from a bucket to a bucket answers what a local job
answers; a rerun skips what any part holds, a part written twice counts once; a second run on
one output is refused while the first holds the lease; a job killed with SIGKILL and rerun
answers every custom_id exactly once; bad URLs, missing buckets and objects each give one line
and exit 2."""

import json
import random

import pytest

from jaxinfer import storage
from jaxinfer.batch import run_batch
from jaxinfer.batch.parts import parts_prefix
from tests.batch_testing import chat, completion, read_jsonl, write_jsonl


def _requests(n: int, seed: int = 0):
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        make = chat if i % 3 == 0 else completion
        lines.append(make(f"q{i}", f"Question {i}: what is {i} plus {i}?", max_tokens=rng.randint(2, 8),
                          temperature=0))
    lines.insert(n // 2, "{not json")
    lines.append(completion("q1", "a duplicate id"))
    return lines


def _upload(store, tmp_path, lines, name="in.jsonl") -> str:
    bucket = store.bucket()
    local = write_jsonl(tmp_path / name, lines)
    url = f"{store.scheme}://{bucket}/jobs/{name}"
    storage.put(storage.parse(url), local.read_bytes())
    return url


def _rows(url: str) -> list[dict]:
    data = storage.read(storage.parse(url))
    assert not data or data.endswith(b"\n")
    return [json.loads(x) for x in data.splitlines()]


def _answers(rows) -> dict:
    """custom_id (or error line) -> what the model said: equal between runs of a greedy job."""
    out = {}
    for r in rows:
        key = r["custom_id"] if r["custom_id"] is not None else ("line", r["error"]["line"])
        assert key not in out, f"{key} answered twice"
        body = (r["response"] or {}).get("body") or {}
        out[key] = (r["response"] or {}).get("status_code"), [
            c.get("text", (c.get("message") or {}).get("content")) for c in body.get("choices", ())], r["error"]


@pytest.fixture(scope="module")
def local_answers(tiny_llm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    inp = write_jsonl(tmp / "in.jsonl", _requests(12))
    run_batch(tiny_llm, inp, tmp / "out.jsonl", progress=False)
    return read_jsonl(tmp / "out.jsonl")


def test_bucket_to_bucket_answers_what_a_local_job_does(tiny_llm, store, tmp_path, local_answers):
    inp = _upload(store, tmp_path, _requests(12))
    out = inp.rsplit("/", 1)[0] + "/out.jsonl"
    s = run_batch(tiny_llm, inp, out, progress=False, part_lines=3)
    assert s.total == 14 and s.result.answered == 14 and s.interrupted is None
    assert _answers(_rows(out)) == _answers(local_answers)
    # finished: the parts and the lease are gone
    assert storage.listing(parts_prefix(storage.parse(out))) == {}
