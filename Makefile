# make install: idempotent; creates .venv and installs the project with its test dependencies.
# torch is pinned to the CPU wheel (2.13.0) on machines without a GPU so that nothing pulls a CUDA build.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_PIN := $(if $(HAS_GPU),torch,torch==2.13.0)
CKPT ?=

.PHONY: install test serve clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)" "numpy<2.4"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# make test: the tests that start Ray alone, after the rest on two workers (tests/conftest.py says why); both parts
# run, and the target fails if either did.
test: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not serial" tests; a=$$?; \
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m serial tests; b=$$?; \
	test $$a -eq 0 -a $$b -eq 0

# make serve: the embedded default (tiny-vision random-weight checkpoint, CPU) on :8000, or CKPT=/path/to/model.
serve: install
	$(BIN)/python -m serve_app $(if $(CKPT),--checkpoint $(CKPT)) $(SERVE_ARGS)

clean-venv:
	rm -rf $(VENV)
