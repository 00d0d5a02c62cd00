"""Benchmark: ``pipeline.reader.read_document`` against the naive reader.

Builds a deterministic ~8 MiB corpus of realistic bug reports and
reproductions (each at most 1 MiB, seeded random), then times, in one run and
side by side:

* naive: ``json.loads`` with a duplicate-key ``object_pairs_hook`` and a
  ``parse_constant`` that refuses NaN/Infinity, then a jsonschema
  ``Draft202012Validator`` (bundled registry, format checker) per document;
* ``read_document`` (msgspec fast path, slow path on any doubt).

It prints MB/s for each and their ratio, and asserts that both reach the same
accept/reject decision on every corpus document and on a few hostile ones.
Run: ``.venv/bin/python benchmarks/bench_reader.py [--profile]``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jsonschema import Draft202012Validator  # noqa: E402

import contracts  # noqa: E402
from pipeline.errors import VianoError  # noqa: E402
from pipeline.reader import _read_fast, read_document  # noqa: E402

MiB = 1 << 20
CORPUS_BYTES = 8 * MiB
DOC_LIMIT = 1 * MiB
SEED = 20240101

_WORDS = (
    "the switch remains off after pressing the button twice while the device reboots "
    "sensor reading drops to zero löst keinen Alarm aus 温度 capteur défaillant timeout "
    "expected value heater relay log entry warning error retry queue stalls at startup"
).split()


def _sentence(rng: random.Random, low: int = 4, high: int = 30) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high))).capitalize() + "."


def _timestamp(rng: random.Random) -> str:
    zone = rng.choice(["Z", "+02:00", "-05:30", "+00:00"])
    return (
        f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T"
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}{zone}"
    )


def _json_value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth < 3 and roll < 0.15:
        return {f"k{i}": _json_value(rng, depth + 1) for i in range(rng.randint(0, 4))}
    if depth < 3 and roll < 0.25:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if roll < 0.45:
        return rng.randint(-10**6, 10**6)
    if roll < 0.6:
        return round(rng.uniform(-1000, 1000), 3)
    if roll < 0.7:
        return rng.choice([True, False, None])
    return _sentence(rng, 1, 6)


def _statement(rng: random.Random) -> dict:
    out = {"text": _sentence(rng)}
    if rng.random() < 0.6:
        out["author"] = f"Tester {rng.choice('ABCDEFG')}"
    if rng.random() < 0.5:
        out["observed_at"] = _timestamp(rng)
    if rng.random() < 0.2:
        out["claim"] = {"key": f"switch.{rng.randint(1, 40)}.state", "value": _json_value(rng)}
    return out


def _entities(rng: random.Random, n: int) -> list:
    return [
        {
            "type": rng.choice(["component", "sensor", "user", "device"]),
            "id": rng.choice([str(rng.randint(1, 500)), rng.randint(1, 500)]),
            "roles": rng.sample(["focus", "affected", "reporter", "context"], rng.randint(0, 2)),
        }
        for _ in range(n)
    ]


def make_report(rng: random.Random, scale: int) -> dict:
    doc = {
        "format": "viano-bug-report",
        "format_version": 1,
        "title": _sentence(rng, 3, 8),
        "summary": _sentence(rng, 10, 40),
        "observations": [_statement(rng) for _ in range(scale)],
        "comments": [_statement(rng) for _ in range(scale // 3)],
        "tester_hypotheses": [_statement(rng) for _ in range(scale // 10 + 1)],
        "expected_behavior": [_statement(rng) for _ in range(scale // 5 + 1)],
        "expected_behavior_complete": rng.random() < 0.5,
        "entities": _entities(rng, scale // 8 + 1),
    }
    if rng.random() < 0.3:
        doc["x-tool"] = {"name": "recorder", "build": rng.randint(1, 9999), "tags": ["a", "b"]}
    return doc


def make_reproduction(rng: random.Random, scale: int) -> dict:
    doc = {
        "format": "viano-reproduction",
        "format_version": 1,
        "steps": [_sentence(rng, 3, 12) for _ in range(scale // 2 + 1)],
        "observations": [_statement(rng) for _ in range(scale // 2)],
        "events_ref": "original/events.log",
        "attachments": [f"original/screens/{i:04d}.png" for i in range(rng.randint(0, 6))],
        "facts": [{"name": f"metric.{i}", "value": _json_value(rng)} for i in range(scale)],
        "entities": _entities(rng, scale // 8 + 1),
    }
    return doc


def build_corpus(total: int = CORPUS_BYTES, seed: int = SEED) -> list[tuple[str, bytes]]:
    """Deterministic (name, bytes) documents adding up to about ``total`` bytes."""
    rng = random.Random(seed)
    corpus: list[tuple[str, bytes]] = []
    size = 0
    while size < total:
        scale = rng.choice([5, 20, 80, 300, 1500, 4000])
        if rng.random() < 0.5:
            name, doc = "report", make_report(rng, scale)
        else:
            name, doc = "reproduction", make_reproduction(rng, scale)
        indent = rng.choice([None, None, 2])
        data = json.dumps(doc, ensure_ascii=rng.random() < 0.3, indent=indent).encode("utf-8")
        if len(data) > DOC_LIMIT:
            continue
        corpus.append((name, data))
        size += len(data)
    return corpus


HOSTILE: list[tuple[str, bytes]] = [
    ("report", b'{"format":"viano-bug-report","format_version":1,"title":"a","title":"b"}'),
    ("report", b'{"format":"viano-bug-report","format_version":1,"observations":[{"text":"x","text":"y"}]}'),
    ("reproduction", b'{"format":"viano-reproduction","format_version":1,"facts":[{"name":"n","value":NaN}]}'),
    ("report", b'{"format":"viano-bug-report","format_version":1,"observations":[{"text":"x","observed_at":"2024-01-01T10:00:00"}]}'),
    ("report", b'{"format":"viano-bug-report","format_version":1,"observations":[{"text":"   "}]}'),
    ("report", b'{"format":"viano-bug-report","format_version":1,"entities":[{"type":"c","id":"1","extra":1}]}'),
    ("report", b'{"format":"viano-bug-report","format_version":2}'),
    ("reproduction", b'{"format":"viano-reproduction","format_version":1} trailing'),
    ("report", b'{"format":"viano-bug-report","format_version":1,"a":1,"\\u0061":2}'),
    ("report", b'{"format":"viano-bug-report","format_version":1,"title":"ok"}'),
]


def _naive_reader():
    def pairs_hook(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
        return dict(pairs)

    def reject_constant(name):
        raise ValueError(f"{name} is not allowed")

    validators = {
        name: Draft202012Validator(
            contracts.SCHEMAS[name], registry=contracts.REGISTRY, format_checker=contracts.FORMAT_CHECKER
        )
        for name in ("report", "reproduction")
    }

    def naive(data: bytes, name: str) -> bool:
        try:
            document = json.loads(data, object_pairs_hook=pairs_hook, parse_constant=reject_constant)
        except (ValueError, RecursionError):
            return False
        return validators[name].is_valid(document)

    return naive


def _fast(data: bytes, name: str) -> bool:
    try:
        read_document(data, name, path="bench", max_bytes=DOC_LIMIT)
    except VianoError:
        return False
    return True


def _time_pair(first, second, corpus, repeat: int):
    """Best-of-``repeat`` times of two readers, alternated so load drifts hit both."""
    best = [float("inf"), float("inf")]
    decisions: list[list[bool]] = [[], []]
    for _ in range(repeat):
        for slot, fn in enumerate((first, second)):
            start = time.perf_counter()
            decisions[slot] = [fn(data, name) for name, data in corpus]
            best[slot] = min(best[slot], time.perf_counter() - start)
    return best, decisions


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="profile read_document on the corpus")
    args = parser.parse_args(argv)

    corpus = build_corpus()
    total = sum(len(d) for _, d in corpus)
    print(f"corpus: {len(corpus)} documents, {total / MiB:.2f} MiB (largest {max(len(d) for _, d in corpus) / MiB:.2f} MiB)")
    naive = _naive_reader()
    (naive_time, fast_time), (naive_decisions, fast_decisions) = _time_pair(naive, _fast, corpus, args.repeat)
    vouched = sum(_read_fast(data, name, DOC_LIMIT) is not None for name, data in corpus)
    assert naive_decisions == fast_decisions, "accept/reject decisions differ on the corpus"
    assert all(fast_decisions), "the corpus is meant to be valid"
    for name, data in HOSTILE:
        assert naive(data, name) == _fast(data, name), f"decisions differ on hostile {data!r}"
    naive_mbs = total / MiB / naive_time
    fast_mbs = total / MiB / fast_time
    print(f"naive (json + hooks + jsonschema): {naive_time:8.3f} s  {naive_mbs:8.2f} MB/s")
    print(f"read_document (msgspec fast path): {fast_time:8.3f} s  {fast_mbs:8.2f} MB/s")
    print(f"ratio: {naive_time / fast_time:.1f}x  (decisions identical on {len(corpus)} + {len(HOSTILE)} hostile; "
          f"fast path vouched for {vouched}/{len(corpus)})")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for name, data in corpus:
            _fast(data, name)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(12)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
