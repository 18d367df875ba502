# Two commands do all set-up on a fresh machine:  make demo   |   make test
VENV   ?= .venv
PY     := $(VENV)/bin/python
GA     := $(VENV)/bin/genartifact
STAMP  := $(VENV)/.installed
MODEL  ?= .models/tiny-qwen3-moe
export HF_HUB_OFFLINE := 1
export VLLM_CPU_KVCACHE_SPACE ?= 1

.PHONY: demo test lint bench mutation fuzz clean

$(STAMP): requirements-dev.txt core/pyproject.toml plugins/*/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	# built against CUDA torch, these break imports on the CPU build ("torchvision::nms does not exist")
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

$(MODEL)/model.safetensors: | $(STAMP)
	$(GA) make-tiny-model $(MODEL) --family qwen3_moe

demo: $(STAMP) $(MODEL)/model.safetensors
	$(eval RUN := demo-$(shell date +%Y%m%dT%H%M%S))
	$(GA) generate --model $(MODEL) --prompts examples/prompts.jsonl --run-id $(RUN)
	$(GA) verify --receipts artifacts/runs/$(RUN)/receipts.jsonl
	$(GA) inspect artifacts/runs/$(RUN)/00000.gart

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check core plugins tests benchmarks mutation

bench: $(STAMP) $(MODEL)/model.safetensors
	$(PY) benchmarks/bench_encode.py
	$(PY) benchmarks/bench_compression.py --model $(MODEL)
	$(PY) benchmarks/bench_capture_overhead.py --model $(MODEL)

# mutation testing (cosmic-ray) of the safety-critical modules; SAMPLE=0 runs every mutant (hours)
SAMPLE ?= 80
mutation: $(STAMP)
	$(PY) mutation/run.py --sample $(SAMPLE)

# long-mode reader fuzz (structure-aware mutations + decompression bombs)
fuzz: $(STAMP)
	$(PY) benchmarks/bench_fuzz_reader.py --cases 200000

clean:
	rm -rf $(VENV) .models artifacts
