# Two commands do all set-up on a fresh machine:  make demo   |   make test
VENV   ?= .venv
PY     := $(VENV)/bin/python
GA     := $(VENV)/bin/genartifact
STAMP  := $(VENV)/.installed
MODEL  ?= .models/tiny-qwen3-moe
export HF_HUB_OFFLINE := 1
export VLLM_CPU_KVCACHE_SPACE ?= 1

.PHONY: demo test lint bench bench-demo mutation fuzz faults clean

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

SMALL  ?= .models/small-qwen3-moe
$(SMALL)/model.safetensors: | $(STAMP)
	$(GA) make-tiny-model $(SMALL) --family qwen3_moe_small

# every benchmark of docs/benchmarks.md that needs no outside server (upload and load start their own SeaweedFS,
# serve its own genartifact server); each prints same-run RATIO lines and the load average. About an hour on
# an idle 2-core box (engine starts, the 45M-parameter model, the FPM fit). Row numbers as in docs/benchmarks.md.
bench: $(STAMP) $(MODEL)/model.safetensors $(SMALL)/model.safetensors demo
	$(PY) benchmarks/bench_encode.py                                                  # 1
	$(PY) benchmarks/bench_compression.py                                             # 2a-2c
	$(PY) benchmarks/bench_capture_overhead.py --model $(MODEL) --floor               # 3a, 3c, 4
	$(PY) benchmarks/bench_capture_overhead.py --model $(SMALL) --requests 32 --goal 0.98  # 3b
	$(PY) benchmarks/bench_driver_request.py --model $(MODEL)                         # 3d (driver CPU/request)
	$(PY) benchmarks/bench_loop_stall.py --model $(MODEL)                             # 3e (long request: loop stall)
	$(PY) benchmarks/bench_worker_finish.py                                           # 3f (long request: worker)
	$(PY) benchmarks/bench_upload.py                                                  # 5, 6
	$(PY) benchmarks/bench_local_write.py                                             # 6b (file:// CPU/object)
	$(PY) benchmarks/bench_serve.py --model $(MODEL)                                  # 8
	$(PY) benchmarks/bench_serve.py --model $(SMALL) --requests 32                    # 8b
	$(PY) benchmarks/bench_fpm.py --model $(MODEL)                                    # 10, 11
	$(PY) benchmarks/bench_load.py                                                    # 12
	$(PY) benchmarks/bench_decode.py                                                  # 13
	$(PY) benchmarks/bench_groups.py                                                  # 14 (GRPO)
	$(PY) benchmarks/bench_fuzz_reader.py --cases 100000                              # 14 (reader fuzz)
	$(PY) benchmarks/bench_per_step_deltas.py --model $(MODEL)                        # 16
	$(PY) benchmarks/bench_replicas.py --model $(MODEL) --rows 16 --max-tokens 16 --max-inflight 8
	$(PY) benchmarks/bench_fpm_fit.py --model $(MODEL) --rounds 2                     # F1
	$(PY) benchmarks/bench_route_recorder.py                                          # worker route recording per step
	$(PY) benchmarks/bench_route_weights.py                                           # route weights: bytes per row
	$(PY) benchmarks/profile_capture.py --model $(MODEL)                              # capture CPU per process (py-spy)

# FPM self-benchmark end to end: two data-parallel ranks (one engine each, pinned to its own core when there
# are two) -> merge -> fit (step-time model, leave-one-point-out error) -> report (report.html). A few minutes: mostly the two engine starts.
BENCH_PORT ?= 20380
bench-demo: $(STAMP) $(MODEL)/model.safetensors
	$(eval OUT := bench/demo-$(shell date +%Y%m%dT%H%M%S))
	@set -e; pin() { [ "$$(nproc)" -ge 2 ] && echo "VLLM_CPU_OMP_THREADS_BIND=$$1" || true; }; \
	env $$(pin 0) $(GA) bench run --model $(MODEL) --out $(OUT) --dp-rank 0 --dp-size 2 --run-id $(notdir $(OUT)) \
	    --max-points 12 --port-base $(BENCH_PORT) & r0=$$!; \
	env $$(pin 1) $(GA) bench run --model $(MODEL) --out $(OUT) --dp-rank 1 --dp-size 2 --run-id $(notdir $(OUT)) \
	    --max-points 12 --port-base $(BENCH_PORT) & r1=$$!; \
	wait $$r0; wait $$r1
	$(GA) bench merge $(OUT)/fpm_rank0.json $(OUT)/fpm_rank1.json --out $(OUT)/merged.json
	$(GA) bench fit $(OUT)/merged.json --out $(OUT)/model.json
	$(GA) bench report $(OUT)/merged.json --model $(OUT)/model.json --out $(OUT)/report

# mutation testing (cosmic-ray) of the safety-critical modules; SAMPLE=0 runs every mutant (hours)
SAMPLE ?= 80
mutation: $(STAMP)
	$(PY) mutation/run.py --sample $(SAMPLE)

# the fault registry: distinct bad inputs and faults tested (tests marked @pytest.mark.fault), per area
faults: $(STAMP)
	$(PY) -m pytest --collect-only -q --faults core/tests plugins tests

# long-mode reader fuzz (structure-aware mutations + decompression bombs)
fuzz: $(STAMP)
	$(PY) benchmarks/bench_fuzz_reader.py --cases 200000

clean:
	rm -rf $(VENV) .models artifacts
