"""clbench's own task files (`clbench/data/tasks/*.yaml`): hub datasets whose items are a field
mapping, declared as data and registered in `clbench.tasks` exactly as a third party's task file
is (one class per file, made by :func:`~clbench.tasks.declared.task_from_file`)."""

from __future__ import annotations

from pathlib import Path

from clbench.tasks.declared import task_from_file

FOLDER = Path(__file__).resolve().parent.parent / "data" / "tasks"

GSM8K = task_from_file(FOLDER / "math.gsm8k.yaml")
MATH500 = task_from_file(FOLDER / "math.math500.yaml")
AIME24 = task_from_file(FOLDER / "math.aime24.yaml")
AIME25 = task_from_file(FOLDER / "math.aime25.yaml")
DAPOMath = task_from_file(FOLDER / "math.dapo17k.yaml")
SciKnowEval = task_from_file(FOLDER / "science.sciknoweval.yaml")
GPQA = task_from_file(FOLDER / "science.gpqa.yaml")
SciQ = task_from_file(FOLDER / "science.sciq.yaml")
MBPP = task_from_file(FOLDER / "code.mbpp.yaml")
HumanEval = task_from_file(FOLDER / "code.humaneval.yaml")
LiveCodeBench = task_from_file(FOLDER / "code.livecodebench.yaml")
DolciCode = task_from_file(FOLDER / "code.dolci.yaml")
