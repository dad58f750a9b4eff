"""Running the README's examples as written: the python blocks of one section, executed in
one namespace (each block continues the ones before it), every ``parlib.launch`` they make
recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import parlib

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_blocks(section: str) -> list[str]:
    """The python code blocks of the README's section titled ``section``, in order."""
    text = README.read_text().split(f"### {section}\n", 1)[1].split("\n### ", 1)[0]
    return [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]


def run_readme_blocks(monkeypatch: Any, section: str,
                      count: int) -> tuple[dict[str, Any], list[list[Any]]]:
    """Execute the first ``count`` blocks of ``section``; (their namespace, per block the
    results of each ``parlib.launch`` it made, with a 300 s timeout for a loaded machine)."""
    launch, returned = parlib.launch, []

    def recording_launch(*args: Any, **kwargs: Any) -> Any:
        returned[-1].append(launch(*args, timeout=300, **kwargs))
        return returned[-1][-1]

    monkeypatch.setattr(parlib, "launch", recording_launch)
    example: dict[str, Any] = {"__name__": "readme_example"}
    for block in readme_blocks(section)[:count]:
        returned.append([])
        exec(block, example)
    return example, returned
