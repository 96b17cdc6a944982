# Two entry points for a fresh clone:
#   make demo   set up .venv and run the main job on the embedded default
#   make test   set up .venv (with the vLLM peer) and run every test tier that this machine can
#               run, then the peer tier again against the next vLLM
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build on machines without a GPU; override with TORCH_SPEC= to keep your own CUDA torch.
TORCH_SPEC ?= torch==2.13.0
VLLM_SPEC ?= vllm==0.33.0
# vLLM 0.34 dropped the V1 runner and its post-process launcher, and renamed fields: the peer
# tier runs a second time against it, from a folder of its own ahead of the venv's vLLM.
VLLM_NEXT_SPEC ?= vllm==0.34.0
PEER_NEXT := $(VENV)/peer-next
PIP := $(PY) -m pip --disable-pip-version-check -q
DEMO_DIR ?= out/demo

.PHONY: venv peer demo test lint docs notebooks bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e '.[dev,report,notebooks]'
	touch $@

venv: $(VENV)/.installed

# The peer tier tests against the real vLLM package; its metadata pins a CUDA torch,
# so it goes in without dependencies, beside the pure-Python packages it imports.
$(VENV)/.peer: $(VENV)/.installed requirements-peer.txt
	$(PIP) install -r requirements-peer.txt
	$(PIP) install --no-deps "$(VLLM_SPEC)"
	touch $@

peer: $(VENV)/.peer

$(PEER_NEXT)/.installed: $(VENV)/.peer
	$(PIP) install --no-deps --no-compile --upgrade --target $(PEER_NEXT) "$(VLLM_NEXT_SPEC)"
	touch $@

demo: $(VENV)/.installed
	mkdir -p $(dir $(DEMO_DIR))
	$(VENV)/bin/mgtrace demo -o $(DEMO_DIR) --force
	$(VENV)/bin/mgtrace sql $(DEMO_DIR) "SELECT mamba_split, reorder_region, count(*) AS rows \
		FROM batch_rows WHERE num_draft > 0 GROUP BY ALL ORDER BY rows DESC"

test: $(VENV)/.peer $(PEER_NEXT)/.installed
	$(PY) -m ruff check mgtrace tests benchmarks
	$(PY) -m pytest -q
	PYTHONPATH=$(PEER_NEXT) $(PY) -m pytest -q -m peer

lint: $(VENV)/.installed
	$(PY) -m ruff check mgtrace tests benchmarks
	$(PY) -m ruff format --check mgtrace tests benchmarks

docs: $(VENV)/.installed
	$(PY) -m mgtrace.schemas.docgen docs/trace-format.md

# Rendered, executed copies of the notebooks (the notebooks themselves stay without outputs).
notebooks: $(VENV)/.installed
	mkdir -p docs/notebooks
	$(VENV)/bin/jupyter nbconvert --to html --execute --output-dir docs/notebooks notebooks/*.ipynb

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache
