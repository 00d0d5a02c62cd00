"""pipeline/commands.py: what export reads to find the case it copies."""

from __future__ import annotations

import pytest

from pipeline.errors import VianoError


def test_export_finds_the_publishing_manifest_from_the_newest_generation_down():
    """A case of 900 generations: export read every manifest from generation
    1 up to find the one that published the current case (1.2 s and 400 MB
    at 300 reopen/append/build cycles; session 25's review). A manifest
    keeps the files of the one before it, so the search goes down and stops
    at the first generation that does not list the case."""
    from pipeline.commands import _publishing_manifest

    class Manifests:
        def __init__(self, listed_from: int):
            self.listed_from = listed_from
            self.asked: list[int] = []

        def manifest(self, generation, *, copy=True):
            self.asked.append(generation)
            files = {"case/revisions/0300/case.json": {}} if generation >= self.listed_from else {}
            return {"package_generation": generation, "files": files}

    package = Manifests(listed_from=899)
    assert _publishing_manifest(package, 900, "case/revisions/0300/case.json")["package_generation"] == 899
    assert package.asked[:3] == [900, 899, 898] and set(package.asked) == {900, 899, 898}
    everywhere = Manifests(listed_from=1)
    assert _publishing_manifest(everywhere, 3, "case/revisions/0300/case.json")["package_generation"] == 1
    with pytest.raises(VianoError) as refused:
        _publishing_manifest(Manifests(listed_from=901), 900, "case/revisions/0300/case.json")
    assert refused.value.code == "INTEGRITY_ERROR"
