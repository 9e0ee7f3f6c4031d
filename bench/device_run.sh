#!/usr/bin/env bash
# One GPU session's work, in as few calls as possible (each call starts a machine):
#   STAGE=tests bash bench/device_run.sh   install, cold build (timed), warm first call, every test
#   STAGE=bench bash bench/device_run.sh   the shape sweep, the backend models, the MoE block
#   STAGE=slower bash bench/device_run.sh  the never-slower checks: the cat_linear sweep, scatter_combine
#                                          at >= 16 MB beside the copy, the backend models, the seeds'
#                                          per-call times (gpu_report.py) and where their host time
#                                          goes (seed_host.py); SLOWER_S (default 300) shared
#   STAGE=paths bash bench/device_run.sh   the fused ops' paths forced, timed in CUDA graphs beside the
#                                          sizes' own pick and eager (cat_linear_paths.py, scatter_paths.py)
#   STAGE=pdl bash bench/device_run.sh     programmatic dependent launch (on by default): its tests, both
#                                          ops' CUDA tests with OPREG_PDL=0, the seeds' times with it and
#                                          without (gpu_report.py); STAGE=paths has a no_pdl column too
#   STAGE=scatter bash bench/device_run.sh scatter_combine's CUDA tests, then the >= 16 MB sweep of the
#                                          short rows (SC_ONLY, default " H128 ": the short-row reducers);
#                                          with SC_ALT=<file> (in the tree) that sweep again with the file
#                                          built as backends/cuda/scatter_combine_large.cu: a back-to-back
#                                          A/B on one machine (bench/sweep_diff.py; <= 5 min); or,
#                                          with SC_FORM_B=multi|fused|local, the B sweep with the large
#                                          path forced into that form (OPREG_SCATTER_COMBINE_LARGE);
#                                          then, with SC_CAND="<diff> ..." (bench/candidates/), each path
#                                          and form forced at the shapes of SC_ROWS (N = T k), the tree
#                                          once, then each candidate (its CUDA tests first), and
#                                          `scatter_paths.py --compare` of each against the tree
#                                          (SC_S=0 skips the sweeps; check a candidate's spills first:
#                                          bench/ptxas_report.py --patch); SC_ROWS alone: the tree's
#                                          paths and forms forced at those N only; a candidate applies
#                                          with `patch -p1` (kernels, path rules, tests); SC_CAND_SWEEP=<s>:
#                                          the op's whole sweep with each candidate applied
#   STAGE=moe bash bench/device_run.sh     the MoE layer: the block vs HF's grouped_mm + Inductor over
#                                          TOKENS_MOE (default 64,4096,16384), host vs GPU time eager and
#                                          compiled (moe_profile.py --inductor), the GEMMs per config
#                                          (moe_gemms.py); MOE_BACKWARD=1: the fused backward's kernels;
#                                          MOE_TUNE=1: `opreg tune moe_experts --backward` into $OUT
#   STAGE=decode bash bench/device_run.sh  the MoE layer at decode: the decode kernels tuned per shape
#                                          (one token and grouped; from CUDA graphs, into
#                                          $OUT/moe_experts_configs.json, then used by what follows), their
#                                          own time against the GEMM path at T = 1-64 and the eager block
#                                          with them and without (moe_decode.py), the block at
#                                          T = 1, 4, 16 and 64 beside HF's eager and compiled
#                                          grouped_mm, the eager block's host side (moe_profile --host-profile)
#   STAGE=targets bash bench/device_run.sh issue 18's T = 4096 / 16384 targets in one call (<= 8 min): the
#                                          replay's GPU tests (TARGETS_TESTS=0 skips them), then the block
#                                          vs HF's grouped_mm + Inductor, fwd and fwd+bwd, each T of
#                                          TOKENS_TARGETS (default "4096 16384 4096") a process of its own with
#                                          the clocks read before it, then bench/moe_replay.py (the replay off /
#                                          on interleaved; then --training: REPLAY_TRAINING off / on, the
#                                          block's training step; TARGETS_TRAINING=0 skips it);
#                                          $OUT/targets.log, $OUT/replay.log, $OUT/replay_training.log
#   STAGE=table bash bench/device_run.sh   issue 18's block table: every variant but HF's eager loop at
#                                          TOKENS_TABLE (default 1,64,512; the large T in a second call,
#                                          TOKENS_TABLE=4096,16384), forward and training, 5 rounds,
#                                          at MIN_BATCH (default 1,5: bench_moe_block.py --min-batch)
#   STAGE=compiled bash bench/device_run.sh  the compiled training step's path (moe_experts_train.TRACED_MIN_FLOPS):
#                                          the block's training step at TOKENS_COMPILED (default 64,512,4096)
#                                          on the grouped path (--traced-min-flops 1e30), then on the fused
#                                          ops (--traced-min-flops 0), whichever the bound picks: each
#                                          process beside HF's compiled grouped_mm and eager opreg;
#                                          INLINE=0/1: moe_experts_train.INLINE_KERNELS for both
#   STAGE=inline bash bench/device_run.sh    the fused kernels inline under torch.compile (moe_experts_train.
#                                          INLINE_KERNELS): tests/test_moe_inline.py, then the compiled
#                                          block at TOKENS_INLINE (default 64,4096), MODES_INLINE (default
#                                          fwd fwd+bwd), with the kernels inline (--inline-kernels 1), the
#                                          same but the training step through the custom ops where eager runs
#                                          Gluon kernels (--gluon-training-ops 1), and through the custom
#                                          ops (0), all on the fused path (--traced-min-flops 0), each process
#                                          beside HF's compiled grouped_mm and eager opreg (batches of
#                                          MIN_BATCH_INLINE, default 5, calls); RUNS_INLINE (default "1,0 1,1
#                                          0,0"): which of the three (INLINE_KERNELS,GLUON_TRAINING_OPS);
#                                          CONFIGS_INLINE (default all three): bench_moe_block.py --configs
#   STAGE=pre bash bench/device_run.sh       the bf16 saved pre-activation (moe_experts.PRE_BF16, on by
#                                          default): its tests (tests/test_moe_triton_backward.py -k
#                                          pre_bf16), then the compiled training step at TOKENS_PRE (default
#                                          4096) with it off (--pre-bf16 0), then on (1), each process beside
#                                          HF's compiled grouped_mm, under bench/moe_profile.py (GPU events and
#                                          each kernel's time: bench_moe_block.py's step moved ~100 us between
#                                          processes, the size of the effect, 2026-12-04)
#   STAGE=dgrad2 bash bench/device_run.sh    GEMM2's dgrad candidates: the GPU cases of the fused kernel's
#                                          epilogue slices and of dgrad2 on a sorted copy of dout (SUBTILE,
#                                          PREGATHER), then bench/moe_backward_profile.py --gemms dgrad2 at
#                                          TOKENS_DGRAD2 (default 4096) on DGRAD2_CONFIGS (default all three:
#                                          the gate pass's tiles and every tune.DGRAD2 candidate, one process;
#                                          ~3 min a config, a guess: one config a call is safe)
#   STAGE=half bash bench/device_run.sh    HALF_TAIL (a GEMM config key, off in the table): its GPU cases,
#                                          then the fused forward with it and without (moe_gemms.py
#                                          --half-tail) and the training step's kernels (moe_launches.py
#                                          --variant), per config of HALF_CONFIGS at TOKENS_HALF (default 4096)
#   STAGE=hang bash bench/device_run.sh    the raw launcher's hang on HALF_TAIL GEMMs (bench/raw_launch_hang.py):
#                                          HANG_VARIANTS (default: default oldkey) on
#                                          HANG_CASES, a process each under `timeout 30` (<= 2 min)
#   STAGE=gluon1 bash bench/device_run.sh  GEMM1 on the Gluon kernels (configs["gemm1"]["GLUON"]): their tests
#                                          (tests/test_moe_gemm1_gluon.py), then its A/B against the table's
#                                          Triton GEMM1 (bench/moe_gemms.py --gluon) on GLUON1_CONFIGS at
#                                          TOKENS_GLUON1 (default 4096); <= 8 min; GLUON1_STEP=1: also the
#                                          training step with it (moe_launches.py --variant; a call of its own);
#                                          GLUON1_DGRAD2=1: GEMM2's dgrad on them taken apart (moe_gemms.py
#                                          --dgrad2; GLUON1_TEST_S=1 GLUON1_AB_S=1 to run it alone)
#   STAGE=buildcost bash bench/device_run.sh  scatter_combine's fused kernel under ncu as the tree has it and
#                                          in two timing builds (wrong outputs): the list building alone,
#                                          and its zero phase and barriers alone (~3 min; BUILDCOST_SHAPES)
#   STAGE=envab bash bench/device_run.sh   a candidate diff's per-call knobs (ENVAB_PATCH, ENVAB_ENV, ENVAB_VALUES,
#                                          ENVAB_SHAPES) timed setting against setting in one process
#                                          (bench/scatter_env_ab.py), the tree rebuilt as it was after
#   STAGE=ab bash bench/device_run.sh      one command timed against two versions of one source:
#                                          AB_CMD (bash; it may write "$AB_JSON") with AB_FILE as the tree
#                                          has it (A), then with AB_ALT built in its place (B; a file in the
#                                          tree, e.g. `git show main:$AB_FILE > ab/x`), back to back on
#                                          one machine; $OUT/ab_a.log, ab_b.log; AB_DIFF=1: sweep_diff B / A
#   (default: tests and bench). Logs and JSON land in $OUT (default /tmp/opreg-out).
# TESTS="tests/x.py ..." narrows the test stage; PYTEST_WORKERS (default 14 of the H200 box's
# 16 cores) runs it with xdist; FIRST_CALL=0 skips the first-call timing.
# Sized for one 10-minute device call: install + cold build ~1 min, the suite <= 5 min, the
# benchmarks each under a timeout (BENCH_S, default 150 s for the three together).
# ONLY_ON=H200 runs nothing and exits 3 unless the GPU's name has that in it: a call asking for
# an H200 may get an H100, so `ONLY_ON=H200 STAGE=tests bash bench/device_run.sh; [ $? = 3 ] &&
# STAGE=... bash bench/device_run.sh` spends a start on H200 work or, failing that, H100 work.
set -uo pipefail
OUT=${OUT:-/tmp/opreg-out}
STAGE=${STAGE:-all}
if [ -n "${ONLY_ON:-}" ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  case "$gpu" in *"$ONLY_ON"*) ;; *) echo "ONLY_ON=$ONLY_ON: this GPU is $gpu; nothing run"; exit 3 ;; esac
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} OPREG_CACHE_DIR=${OPREG_CACHE_DIR:-/tmp/opreg-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -20 "$OUT/install.log"
python3 -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(), '| transformers', transformers.__version__)"
date -u +%FT%TZ

if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
  /usr/bin/time -f "cold build of every library: %e s wall" python3 -m opreg build 2>&1 | tee "$OUT/build.log"
  python3 -m opreg build 2>&1 | tail -4                       # warm: every library "cached"
  [ "${FIRST_CALL:-1}" = 1 ] && python3 bench/first_call.py --device cuda --runs 5 2>&1 | tee "$OUT/first_call.log"
  W=${PYTEST_WORKERS:-14}
  # pytest-xdist is on the device image. --dist load, not pyproject's loadfile: on 14 workers
  # a file's GPU cases would otherwise queue on one worker (the two Triton MoE files' GPU
  # cases did not finish in 250 s that way, 2026-12-02); the interpreter children run once per
  # run (tests/_fresh.py's once_per_run lock), whichever workers take their cases.
  XDIST="-n $W --dist ${PYTEST_DIST:-load}"
  # One CPU thread per worker, and Inductor compiling in its worker's process: 14 workers
  # each with torch's 16 intra-op threads and a 16-process compile pool oversubscribe the
  # 16 cores (the suite is CPU-bound there: Triton and Inductor compiles, the interpreter
  # children, float64 references). 2026-12-02, main at 25b24a1 without this: 317.7 s.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
  # -v: each result is in $OUT/tests.log as it happens (a run cut by the call's limit still
  # names its failures); the terminal gets the failures, the slowest tests and the summary.
  # faulthandler_timeout: a test still running after 180 s prints every thread's stack (the
  # HALF_TAIL hang of 2026-12-05 held two workers until the call's limit, naming nothing)
  /usr/bin/time -f "the test suite: %e s wall" python3 -m pytest ${TESTS:-tests} -v -p no:cacheprovider $XDIST \
    -o faulthandler_timeout=${FAULT_S:-180} \
    -rfE --durations=25 --junitxml "$OUT/junit.xml" 2>&1 | tee "$OUT/tests.log" | grep -E "FAILED|ERROR|s (call|setup)|passed|failed|wall"
fi

if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  python3 -m opreg build >/dev/null 2>&1
  B=${BENCH_S:-150}
  timeout $((B / 3 + 15)) python3 bench/sweep.py --budget-s $((B / 3)) --json "$OUT/sweep.json" 2>&1 \
    | tee "$OUT/sweep.log" | tail -40
  timeout $((B / 3)) python3 bench/backend_models.py --json "$OUT/backend_models.json" 2>&1 \
    | tee "$OUT/backend_models.log" | tail -12
  timeout $((B / 3)) python3 bench/bench_moe_block.py --rounds 7 2>&1 | tee "$OUT/moe_block.log" | tail -20
fi

if [ "$STAGE" = slower ]; then
  # Built here, into this script's OPREG_CACHE_DIR: a bench run from the call's command line
  # without it exported builds into ~/.cache instead, inside its own time budget (the
  # scatter sweep of 2026-12-02's last call spent its 60 s building and timed nothing).
  python3 -m opreg build >/dev/null 2>&1
  S=${SLOWER_S:-300}
  # --confirm-rounds: a shape > 3 % slower is timed again with 21 rounds (7 left eager's own
  # spread above 3 % at 111-148 of 180 shapes, 2026-12-02); that run is the verdict
  timeout $((S * 35 / 100 + 15)) python3 bench/sweep.py --ops cat_linear,cat_linear_stacked --budget-s $((S * 35 / 100)) \
    --confirm-rounds 21 --json "$OUT/sweep_cat.json" > "$OUT/sweep_cat.log" 2>&1
  grep -E -A4 "slower than eager by|timed again" "$OUT/sweep_cat.log" | head -24
  timeout $((S * 25 / 100 + 15)) python3 bench/sweep.py --ops scatter_combine --min-mb 16 --inductor none \
    --budget-s $((S * 25 / 100)) --json "$OUT/sweep_sc.json" > "$OUT/sweep_sc.log" 2>&1; grep -A12 "below 70" "$OUT/sweep_sc.log"
  timeout $((S * 25 / 100)) python3 bench/backend_models.py --json "$OUT/backend_models.json" > "$OUT/backend_models.log" 2>&1
  grep -v "^ \|[Ww]arn" "$OUT/backend_models.log" | tail -16
  timeout $((S * 15 / 100)) python3 bench/gpu_report.py > "$OUT/gpu_report.log" 2>&1; grep -E "^\| (scatter 1536|cat_linear R4 B12)" "$OUT/gpu_report.log"
  # where the seeds' host time per call goes (~15 s; scatter_combine 9.7 us against cat_linear's 7.4)
  timeout 60 python3 bench/seed_host.py > "$OUT/seed_host.log" 2>&1; grep "us a call" "$OUT/seed_host.log"
  rm -f "$OUT/install.log"  # a call returns at most 8 files (seven here, with seed_host.log eight)
fi

if [ "$STAGE" = paths ]; then
  python3 -m opreg build >/dev/null 2>&1
  # the fused ops' paths, each forced, device time from CUDA graphs (the host taken out):
  # cat_linear's dot / SIMT / GEMM and scatter_combine's tiny / small / large forward, beside
  # the sizes' own pick and eager (each timed in two orders: ~3 min together)
  timeout 190 python3 bench/cat_linear_paths.py --json "$OUT/cat_linear_paths.json" > "$OUT/cat_linear_paths.log" 2>&1
  grep -A12 "^[0-9]* shapes" "$OUT/cat_linear_paths.log"; grep -A10 "^auto / no_pdl" "$OUT/cat_linear_paths.log"
  timeout 120 python3 bench/scatter_paths.py --json "$OUT/scatter_paths.json" > "$OUT/scatter_paths.log" 2>&1
  grep -A12 "^[0-9]* shapes" "$OUT/scatter_paths.log"; grep -A10 "^auto / no_pdl" "$OUT/scatter_paths.log"
fi

if [ "$STAGE" = pdl ]; then
  python3 -m opreg build >/dev/null 2>&1
  # programmatic dependent launch (backends/cuda/pdl.cuh; on by default on sm_90+, off with
  # OPREG_PDL=0): its tests, then both ops' CUDA tests without it (STAGE=tests runs them with
  # it), then the seeds' per-call and CUDA-graph times with it and without, and after a
  # foreign kernel (gpu_report.py; ~2 min)
  python3 -m pytest -q -n ${PYTEST_WORKERS:-14} --dist load tests/test_pdl.py 2>&1 | tail -5
  OPREG_PDL=0 python3 -m pytest -q -n ${PYTEST_WORKERS:-14} --dist load tests/test_cat_linear.py \
    tests/test_scatter_combine.py -k cuda 2>&1 | tail -5
  timeout 200 python3 bench/gpu_report.py --json "$OUT/gpu_report.json" > "$OUT/gpu_report.log" 2>&1
  grep -E "^# |^\| (case|host|scatter 1536|cat_linear R4 B12|cat_linear R4 B64)" "$OUT/gpu_report.log"
fi

if [ "$STAGE" = scatter ]; then
  python3 -m opreg build >/dev/null 2>&1
  # the tests' summary again at the end: the sweeps' lines push it out of a call's output tail
  python3 -m pytest -q -n ${PYTEST_WORKERS:-14} --dist load tests/test_scatter_combine.py -k cuda \
    > "$OUT/sc_tests.log" 2>&1
  tail -3 "$OUT/sc_tests.log"
  sc_sweep() {  # $1: the run's name (its log and JSON in $OUT)
    timeout $((${SC_S:-100} + 15)) python3 bench/sweep.py --ops scatter_combine --min-mb 16 --inductor none \
      --only "${SC_ONLY:- H128 }" --budget-s ${SC_S:-100} --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1
    grep -E "in a CUDA graph|sweep took" "$OUT/$1.log"
  }
  if [ "${SC_S:-100}" != 0 ]; then  # SC_S=0: no sweep (SC_CAND's runs only)
    sc_sweep sweep_sc_a
    if [ -n "${SC_ALT:-}" ]; then
      cp backends/cuda/scatter_combine_large.cu /tmp/sc_large_a.cu
      cp "$SC_ALT" backends/cuda/scatter_combine_large.cu
      python3 -m opreg build --only cuda 2>&1 | tail -1
      sc_sweep sweep_sc_b
      cp /tmp/sc_large_a.cu backends/cuda/scatter_combine_large.cu
      python3 -m opreg build --only cuda >/dev/null 2>&1
      python3 bench/sweep_diff.py "$OUT/sweep_sc_a.json" "$OUT/sweep_sc_b.json" | tail -4
    elif [ -n "${SC_FORM_B:-}" ]; then
      OPREG_SCATTER_COMBINE_LARGE="$SC_FORM_B" sc_sweep sweep_sc_b
      python3 bench/sweep_diff.py "$OUT/sweep_sc_a.json" "$OUT/sweep_sc_b.json" | tail -4
    fi
  fi
  if [ -n "${SC_CAND:-}" ] || [ -n "${SC_ROWS:-}" ]; then
    # a candidate diff from the repository root (bench/candidates/; `patch -p1`, so it may touch
    # the kernels, the path rules and their tests): the paths and the large path's forms forced
    # (bench/scatter_paths.py) at the shapes whose N = T k is in SC_ROWS, the tree's, then the
    # candidate's after its CUDA tests; then scatter_paths.py --compare on the two (B / A per
    # form, local / fused by token_idx's bytes); SC_CAND_SWEEP=<s>: then the op's whole sweep
    # (bench/sweep.py, that budget) with the candidate applied. SC_ROWS without SC_CAND: the
    # tree's run only (--evaluate it here for the bounds)
    sc_paths() {  # $1: the run's name (its log and JSON in $OUT)
      timeout ${SC_PATHS_S:-150} python3 bench/scatter_paths.py --max-rows 65536 --reps ${SC_REPS:-10} \
        --rows "${SC_ROWS:-2048,3072,4096,8192,16384}" --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1
      grep -E "shapes;" "$OUT/$1.log"
    }
    sc_paths paths_tree
    for cand in ${SC_CAND:-}; do  # several: each against the tree, one machine start for all
      c=$(basename "$cand" .diff)
      if patch -s -p1 < "$cand"; then
        python3 -m opreg build --only cuda 2>&1 | tail -1
        python3 -m pytest -q -n ${PYTEST_WORKERS:-14} --dist load tests/test_scatter_combine.py -k cuda \
          > "$OUT/tests_$c.log" 2>&1
        echo "scatter_combine's CUDA tests with $cand: $(tail -1 "$OUT/tests_$c.log")"
        sc_paths "paths_$c"
        # into a file first: `| head` closed the pipe on the list of moved shapes (BrokenPipeError)
        python3 bench/scatter_paths.py --compare "$OUT/paths_tree.json" "$OUT/paths_$c.json" \
          > "$OUT/compare_$c.log" 2>&1
        head -30 "$OUT/compare_$c.log"
        if [ -n "${SC_CAND_SWEEP:-}" ]; then
          timeout $((SC_CAND_SWEEP + 30)) python3 bench/sweep.py --ops scatter_combine --inductor none \
            --budget-s "$SC_CAND_SWEEP" --json "$OUT/sweep_$c.json" > "$OUT/sweep_$c.log" 2>&1
          tail -8 "$OUT/sweep_$c.log"
        fi
        patch -s -R -p1 < "$cand"
      else
        echo "SC_CAND: $cand does not apply to the tree"
      fi
    done
    python3 -m opreg build --only cuda >/dev/null 2>&1
  fi
  echo "scatter_combine's CUDA tests: $(tail -1 "$OUT/sc_tests.log")"
  rm -f "$OUT/install.log"
fi

if [ "$STAGE" = moe ]; then
  python3 -m opreg build >/dev/null 2>&1
  # the block side by side with HF's fastest only (the eager Qwen3-MoE block took 1111 us
  # beside four compiled variants, 803 us in a process of its own, 2026-12-02), then where
  # its time goes
  timeout 200 python3 bench/bench_moe_block.py --tokens "${TOKENS_MOE:-64,4096,16384}" --rounds 7 \
    --variants hf_grouped_mm_inductor opreg 2>&1 | tee "$OUT/moe_block.log" | grep "^|"
  (cd bench && timeout 150 python3 moe_profile.py --tokens 64,4096 --inductor 2>&1 | tee "$OUT/moe_profile.log" \
    | grep -E "^[a-z].*T=|  (op|block)")
  timeout 100 python3 bench/moe_gemms.py --tokens 4096 2>&1 | tee "$OUT/moe_gemms.log" | grep -E "^[a-z]|fused"
  [ "${MOE_BACKWARD:-0}" = 1 ] && (cd bench && timeout 150 python3 moe_backward_profile.py --no-tune 2>&1 \
    | tee "$OUT/moe_backward_profile.log" | grep -E "T=")
  # MOE_TUNE=1: the block configs for the three shapes, forward and the training path's
  # dgrads, into a copy of the table in $OUT (commit it as backends/triton/moe_experts_configs.json)
  [ "${MOE_TUNE:-0}" = 1 ] && timeout $((${TUNE_S:-240} + 60)) python3 -m opreg tune moe_experts --backward \
    --tokens "${TOKENS_TUNE:-4096}" --budget-s "${TUNE_S:-240}" --out "$OUT/moe_experts_configs.json" 2>&1 \
    | tee "$OUT/tune.log" | grep -E "E=|backward|wrote"
fi

if [ "$STAGE" = targets ]; then
  python3 -m opreg build >/dev/null 2>&1
  [ "${TARGETS_TESTS:-1}" = 1 ] && timeout 150 python3 -m pytest -q -n 14 --dist load -p no:cacheprovider \
    -k "replay or launch_cache" tests/test_moe_triton.py tests/test_triton_replay.py tests/test_moe_triton_backward.py \
    2>&1 | tail -3
  # each T in a process of its own: a process's first config has read slow (fifty-ninth and
  # sixty-second sessions), so T = 4096 twice; the clocks before each (the power cap)
  for t in ${TOKENS_TARGETS:-4096 16384 4096}; do
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader | tee -a "$OUT/targets.log"
    (cd bench && timeout 200 python3 bench_moe_block.py --tokens "$t" --modes fwd fwd+bwd \
      --variants hf_grouped_mm_inductor opreg --rounds 5 --min-batch 5 2>&1) | tee -a "$OUT/targets.log" | grep "^|"
  done
  timeout 150 python3 bench/moe_replay.py 2>&1 | tee "$OUT/replay.log" | grep -E "^device|host|block"
  # the training forward replayed (moe_experts.REPLAY_TRAINING, off by default until this reads)
  [ "${TARGETS_TRAINING:-1}" = 1 ] && timeout 180 python3 bench/moe_replay.py --training --rounds 9 2>&1 \
    | tee "$OUT/replay_training.log" | grep -E "^device|host|block"
fi

if [ "$STAGE" = table ]; then
  python3 -m opreg build >/dev/null 2>&1
  # both batch regimes (a batch of one call charges each call the host's start-up; five
  # back-to-back calls cost the larger of host and GPU, as a model's layers do)
  timeout ${TABLE_S:-480} python3 bench/bench_moe_block.py --tokens "${TOKENS_TABLE:-1,64,512}" --rounds 5 \
    --min-batch "${MIN_BATCH:-1,5}" 2>&1 | tee "$OUT/moe_table.log" | grep "^|"
fi

if [ "$STAGE" = decode ]; then
  python3 -m opreg build >/dev/null 2>&1
  # tuned into a copy of the table in $OUT (commit it as backends/triton/moe_experts_configs.json),
  # copied over this checkout's table so that the runs below use the winners
  timeout $((${TUNE_S:-90} + 60)) python3 -m opreg tune moe_experts --decode --reps 20 --budget-s "${TUNE_S:-90}" \
    --out "$OUT/moe_experts_configs.json" 2>&1 | tee "$OUT/tune_decode.log" | grep -E "E=|wrote"
  [ -s "$OUT/moe_experts_configs.json" ] && cp "$OUT/moe_experts_configs.json" backends/triton/moe_experts_configs.json
  # the kernels' own time, from a CUDA graph (an eager call at T = 1 is all host there)
  # (--block: the eager block with the decode kernels' token bound at 1 and at T, interleaved)
  # (its grouped candidates at each T: ~170 s for T = 1-16 with --kernels, 2026-12-03)
  # (T = 8-64 with --block, 4 candidates: ~170 s, 2026-12-03)
  timeout 200 python3 bench/moe_decode.py --tokens 1,4,16,64 --block --rounds 5 2>&1 | tee "$OUT/moe_decode.log" | grep "^|"
  timeout 200 python3 bench/bench_moe_block.py --tokens 1,4,16,64 --rounds 7 \
    --variants hf_grouped_mm hf_grouped_mm_inductor opreg opreg_inductor 2>&1 | tee "$OUT/moe_block_decode.log" | grep "^|"
  (cd bench && timeout 150 python3 moe_profile.py --tokens 4096 --configs qwen3_moe mixtral --host-profile \
    > "$OUT/moe_profile_host.log" 2>&1; grep -E "^[a-z].*T=|  (op|block)" "$OUT/moe_profile_host.log")
fi

if [ "$STAGE" = inline ]; then
  python3 -m opreg build >/dev/null 2>&1
  timeout ${INLINE_TEST_S:-300} python3 -m pytest -q -n 0 tests/test_moe_inline.py 2>&1 | tee "$OUT/inline_tests.log" | tail -3
  # inline (the training step's kernels in the graph), inline but the training step through the
  # custom ops where eager runs Gluon kernels (GLUON_TRAINING_OPS), the custom ops throughout
  for run in ${RUNS_INLINE:-1,0 1,1 0,0}; do
    timeout ${INLINE_S:-200} python3 bench/bench_moe_block.py --tokens "${TOKENS_INLINE:-64,4096}" \
      --modes ${MODES_INLINE:-fwd fwd+bwd} --rounds 5 --min-batch "${MIN_BATCH_INLINE:-5}" \
      --variants hf_grouped_mm_inductor opreg opreg_inductor --traced-min-flops 0 \
      --inline-kernels "${run%,*}" --gluon-training-ops "${run#*,}" ${CONFIGS_INLINE:+--configs $CONFIGS_INLINE} \
      2>&1 | tee "$OUT/moe_inline_${run/,/_}.log" | grep -E "^\||INLINE|GLUON"
  done
fi

if [ "$STAGE" = pre ]; then
  python3 -m opreg build >/dev/null 2>&1
  timeout ${PRE_TEST_S:-150} python3 -m pytest -q -n 8 -k pre_bf16 tests/test_moe_triton_backward.py 2>&1 \
    | tee "$OUT/pre_tests.log" | tail -3
  for on in 0 1; do
    (cd bench && timeout ${PRE_S:-220} python3 moe_profile.py --tokens "${TOKENS_PRE:-4096}" --inductor --skip-op \
      --modes fwd+bwd --variants hf_grouped_mm_inductor opreg_inductor --pre-bf16 "$on" 2>&1) \
      | tee "$OUT/prof_pre_$on.log" | grep -E "block fwd|PRE_BF16"
  done
fi

if [ "$STAGE" = dgrad2 ]; then
  python3 -m opreg build >/dev/null 2>&1
  timeout ${DGRAD2_TEST_S:-150} python3 -m pytest -q -n 8 -k "cuda_cases and (epilogue or pregathered)" \
    tests/test_moe_triton_backward.py 2>&1 | tee "$OUT/dgrad2_tests.log" | tail -3
  (cd bench && timeout ${DGRAD2_S:-420} python3 moe_backward_profile.py --tokens "${TOKENS_DGRAD2:-4096}" \
    --configs ${DGRAD2_CONFIGS:-mixtral qwen3_moe olmoe} --gemms dgrad2 2>&1) | tee "$OUT/dgrad2.log" | grep -E "T=[0-9]+:|gate pass|dgrad2"
fi

if [ "$STAGE" = compiled ]; then
  python3 -m opreg build >/dev/null 2>&1
  # both paths at every T (the shipped bound picks one of them per T); two processes, since
  # the bound is read when Dynamo traces
  for bound in 1e30 0; do
    timeout ${COMPILED_S:-240} python3 bench/bench_moe_block.py --tokens "${TOKENS_COMPILED:-64,512,4096}" --modes fwd+bwd \
      --rounds 5 --variants hf_grouped_mm_inductor opreg opreg_inductor --traced-min-flops "$bound" \
      ${INLINE:+--inline-kernels "$INLINE"} 2>&1 \
      | tee "$OUT/moe_compiled_$bound.log" | grep -E "^\||TRACED"
  done
fi

if [ "$STAGE" = hang ]; then
  # one process a (variant, case): a hang is rc 124 after the last "call i ok" line
  IFS=';' read -ra cases <<< "${HANG_CASES:-half tail blocks}"
  for c in "${cases[@]}"; do
    for v in ${HANG_VARIANTS:-default oldkey}; do
      timeout 30 python3 bench/raw_launch_hang.py "$v" "$c" 2>&1 | grep " | call " | tail -1
      echo "$v | $c | rc ${PIPESTATUS[0]}"
    done
  done
fi

if [ "$STAGE" = half ]; then
  python3 -m opreg build >/dev/null 2>&1
  # HALF_TAIL (half a tile where a block's second half is padding; off in the table): its
  # GPU cases, then its A/B, one process a config: the no-grad forward (moe_gemms.py
  # --half-tail: the table's configs, GEMM2 not persistent, HALF_TAIL on GEMM1, on both,
  # interleaved), then the training step's kernels beside the table's (moe_launches.py
  # --variant; Mixtral's dgrad2 runs on CUTLASS, which has no such mode: forward only there)
  # HALF_TESTS=0: the cases ran in this session's suite already
  [ "${HALF_TESTS:-1}" = 1 ] && timeout 150 python3 -m pytest -q -n 14 --dist load -k "half" -p no:cacheprovider \
    tests/test_moe_triton.py tests/test_moe_triton_backward.py 2>&1 | tail -3
  for c in ${HALF_CONFIGS:-qwen3_moe olmoe mixtral}; do
    timeout ${HALF_FWD_S:-90} python3 bench/moe_gemms.py --half-tail --configs "$c" --tokens "${TOKENS_HALF:-4096}" \
      > "$OUT/half_fwd_$c.log" 2>&1; grep -A5 "interleaved rounds" "$OUT/half_fwd_$c.log"
  done
  fwd='"gemm1": {"HALF_TAIL": 1}, "gemm2": {"HALF_TAIL": 1, "PERSISTENT": 0}'
  for c in ${HALF_CONFIGS:-qwen3_moe olmoe mixtral}; do
    back=', "dgrad2": {"HALF_TAIL": 1}, "dgrad1": {"HALF_TAIL": 1, "PERSISTENT": 0, "GROUPED_MM": 0}'
    [ "$c" = mixtral ] && back=''
    (cd bench && timeout ${HALF_STEP_S:-120} python3 moe_launches.py --configs "$c" --rounds 7 \
      --variant "half={$fwd$back}" > "$OUT/half_step_$c.log" 2>&1)
    grep -E "T=[0-9]+ |rounds;|half:|table's configs, given:" "$OUT/half_step_$c.log"
  done
fi

if [ "$STAGE" = gluon1 ]; then
  # GEMM1 on the Gluon kernels (configs["gemm1"]["GLUON"] 1 ping-pong, 2 cooperative; moe_gemm1_gluon.py;
  # the cooperative one the default from 256 rows per expert on; GEMM2 on it, configs["gemm2"]["GLUON"] 2):
  # its cases (every gate, the pre-activation saved, both epilogues, NaN-filled buffers, a CUDA
  # graph, training against the Triton GEMM1, the default's own, GEMM2's), then its A/B against the
  # table's Triton GEMMs per config (GEMM1 alone, GEMM2 alone, then the fused forward with and
  # without save, interleaved rounds)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
  timeout ${GLUON1_TEST_S:-150} env OPREG_CHECK_SPEC=1 python3 -m pytest -q -p no:cacheprovider -n 14 --dist load \
    -rfE tests/test_moe_gemm1_gluon.py > "$OUT/gluon1_tests.log" 2>&1
  echo "tests rc $?"; grep -E "FAILED|ERROR |passed|failed" "$OUT/gluon1_tests.log" | tail -12
  timeout ${GLUON1_AB_S:-300} python3 bench/moe_gemms.py --gluon --configs ${GLUON1_CONFIGS:-qwen3_moe olmoe mixtral} \
    --tokens "${TOKENS_GLUON1:-4096}" --rounds ${GLUON1_ROUNDS:-7} > "$OUT/gluon1_ab.log" 2>&1
  echo "A/B rc $?"; grep -vE "[Ww]arn" "$OUT/gluon1_ab.log" | tail -45
  # GLUON1_STEP=1 (a call of its own: ~2-3 min): the training step with GEMM1 on it (the default's
  # kernel, given), with GEMM2 on the cooperative Gluon kernel too, and with GEMM2's dgrad on the
  # ping-pong one, beside the table's configs given the same way (moe_launches.py --variant: keys
  # over the table's), 5 rounds, then each kernel
  if [ "${GLUON1_STEP:-0}" = 1 ]; then
    (cd bench && timeout ${GLUON1_STEP_S:-240} python3 moe_launches.py --configs ${GLUON1_CONFIGS:-qwen3_moe olmoe mixtral} \
      --tokens "${TOKENS_GLUON1:-4096}" --rounds 5 \
      --variant 'gluon_coop={"gemm1": {"GLUON": 2, "BLOCK_M": 128, "HALF_TAIL": 0, "PERSISTENT": 0}}' \
      --variant 'gemm2_coop={"gemm1": {"GLUON": 2, "BLOCK_M": 128, "HALF_TAIL": 0, "PERSISTENT": 0}, "gemm2": {"GLUON": 2, "HALF_TAIL": 0, "PERSISTENT": 0}}' \
      --variant 'dgrad2_pp={"gemm1": {"GLUON": 2, "BLOCK_M": 128, "HALF_TAIL": 0, "PERSISTENT": 0}, "dgrad2": {"GLUON": 1}}' \
      > "$OUT/gluon1_step.log" 2>&1)
    echo "step rc $?"; grep -E "T=[0-9]+ |rounds;|gluon_coop:|gemm2_coop:|dgrad2_pp:|table's configs, given:" "$OUT/gluon1_step.log"
  fi
  # GLUON1_DGRAD2=1: GEMM2's dgrad on the Gluon kernels taken apart (moe_gemms.py --dgrad2, ~1 min)
  if [ "${GLUON1_DGRAD2:-0}" = 1 ]; then
    timeout ${GLUON1_DGRAD2_S:-150} python3 bench/moe_gemms.py --dgrad2 --configs ${GLUON1_CONFIGS:-qwen3_moe olmoe mixtral} \
      --tokens "${TOKENS_GLUON1:-4096}" --reps 20 > "$OUT/gluon1_dgrad2.log" 2>&1
    echo "dgrad2 rc $?"; grep -vE "[Ww]arn" "$OUT/gluon1_dgrad2.log" | grep -E "T=|us|bit-identical"
  fi
fi

if [ "$STAGE" = ab ]; then
  : "${AB_FILE:?AB_FILE: the source to swap}" "${AB_ALT:?AB_ALT: its B version}" "${AB_CMD:?AB_CMD: what to time}"
  python3 -m opreg build >/dev/null 2>&1
  cp "$AB_FILE" /tmp/ab_a.src
  for v in a b; do
    # the build hashes the headers into every compile, so a header swap rebuilds what includes it
    [ $v = b ] && { cp "$AB_ALT" "$AB_FILE"; python3 -m opreg build 2>&1 | tail -1; }
    AB_JSON="$OUT/ab_$v.json" timeout ${AB_S:-250} bash -c "$AB_CMD" > "$OUT/ab_$v.log" 2>&1
    rc=$?; src=$AB_ALT; [ $v = a ] && src="$AB_FILE as the tree has it"
    echo "== $v ($src): rc $rc"
    tail -${AB_TAIL:-12} "$OUT/ab_$v.log"
  done
  cp /tmp/ab_a.src "$AB_FILE"; python3 -m opreg build >/dev/null 2>&1
  [ "${AB_DIFF:-0}" = 1 ] && python3 bench/sweep_diff.py "$OUT/ab_a.json" "$OUT/ab_b.json" | tail -6
  rm -f "$OUT/install.log"
fi

if [ "$STAGE" = buildcost ]; then
  # The list building's share of the fused scatter_combine kernel (issue 19, acceptance 3; the
  # seventieth session: it spends 5-9 us more than its reduce). ncu's duration of
  # scatter_large_fused_kernel with the file as the tree has it (main), then two timing builds
  # whose outputs are wrong (never to land): "build" returns right after build_lists (the
  # reducer stays compiled, so main's registers and grid), "zero" also skips its count_rows
  # (the zero phase and the grid barriers alone). main - build: the reduce; build - zero: the
  # count phase. BUILDCOST_SHAPES: T,k,H;... (bf16, random, int32). ~3 min.
  F=backends/cuda/scatter_combine_large.cu
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { echo "STAGE=buildcost: no ncu on this machine"; exit 1; }
  cp "$F" /tmp/bc_main.cu
  sed '/^  build_lists(idx, idx64, n, num_tokens, flag, counts, ell, ooff, slot, operm, cursor);$/a\  if (hvec > 0) return;  // TIMING BUILD: the list building alone' /tmp/bc_main.cu > /tmp/bc_build.cu
  sed '/^__device__ __noinline__ void build_lists(/,/^}/ s/^  count_rows(\(.*\));$/  if (n < 0) count_rows(\1);  \/\/ TIMING BUILD: no count/' /tmp/bc_build.cu > /tmp/bc_zero.cu
  if [ "$(grep -c 'TIMING BUILD' /tmp/bc_build.cu)" != 1 ] || [ "$(grep -c 'TIMING BUILD' /tmp/bc_zero.cu)" != 2 ]; then
    echo "STAGE=buildcost: its two edits no longer match $F (build_lists / scatter_large_fused_kernel)"; exit 1
  fi
  SH=${BUILDCOST_SHAPES:-"16384,1,1024;65536,2,128;4096,1,1024;16384,8,128;16384,2,1024"}
  echo "shapes (two launches each, in this order): $SH"
  for v in main build zero; do
    cp /tmp/bc_$v.cu "$F"; python3 -m opreg build --only cuda 2>&1 | tail -1
    OPREG_SCATTER_COMBINE_LARGE=fused timeout 150 "$NCU" --clock-control none --section SpeedOfLight \
      --section LaunchStats -k regex:scatter_large_fused_kernel python3 bench/scatter_reduce_ncu.py \
      --no-lists --shapes "$SH" > "$OUT/buildcost_$v.txt" 2>&1
    echo "== $v (us): $(grep -E '^ +Duration' "$OUT/buildcost_$v.txt" | awk '{printf "%s ", $NF}')"
    grep -E "^ +Registers Per Thread" "$OUT/buildcost_$v.txt" | sort | uniq -c | head -3
  done
  cp /tmp/bc_main.cu "$F"; python3 -m opreg build --only cuda >/dev/null 2>&1
  rm -f "$OUT/install.log"
fi

if [ "$STAGE" = envab ]; then
  # A candidate's knobs read per call (environment variables), their settings side by side in
  # one process (bench/scatter_env_ab.py: a CUDA graph per setting, replays interleaved, bits
  # checked against the first setting's): ENVAB_PATCH (a diff against backends/cuda/, e.g. the
  # seventy-first session's prefetch_x.diff, in git history) applied to a copy and built in
  # place, the tree's files put back and rebuilt after. ENVAB_VALUES (comma-separated; a value
  # of ENVAB_ENV, or NAME=v+NAME2=w; the first is the baseline), ENVAB_SHAPES.
  : "${ENVAB_PATCH:?ENVAB_PATCH: the candidate diff}" "${ENVAB_VALUES:?ENVAB_VALUES: the settings}"
  rm -rf /tmp/envab_keep && mkdir -p /tmp/envab_keep && cp -r backends/cuda /tmp/envab_keep/
  if git apply "$ENVAB_PATCH"; then
    python3 -m opreg build --only cuda 2>&1 | tail -1
    timeout ${ENVAB_S:-240} python3 bench/scatter_env_ab.py ${ENVAB_ENV:+--env "$ENVAB_ENV"} --values "$ENVAB_VALUES" \
      --shapes "${ENVAB_SHAPES:-65536,2,128;65536,1,128;16384,1,1024;16384,2,1024;16384,8,128;4096,8,4096}" \
      --rounds ${ENVAB_ROUNDS:-9} --json "$OUT/envab.json" 2>&1 | tee "$OUT/envab.log" | grep -v "^opreg:"
  else
    echo "STAGE=envab: $ENVAB_PATCH does not apply"
  fi
  # ENVAB_REBUILD=0: the files put back but not rebuilt (the call's last stage)
  rm -rf backends/cuda && cp -r /tmp/envab_keep/cuda backends/
  [ "${ENVAB_REBUILD:-1}" = 1 ] && python3 -m opreg build --only cuda >/dev/null 2>&1
  rm -f "$OUT/install.log"
fi

# A call brings back at most 8 files from $OUT. Stages chained in one call can write more, and
# the rest would be lost: on 2026-12-05, STAGE=slower then STAGE=pdl wrote 11 files, and the
# scatter sweep's JSON and log stayed behind. Past 8, every file moves into $OUT/out.tar
# (`tar xf out.tar`), which each later stage appends to.
n_out=$(find "$OUT" -type f ! -name out.tar | wc -l)
if [ -f "$OUT/out.tar" ] || [ "$n_out" -gt 8 ]; then
  (cd "$OUT" && find . -type f ! -name out.tar | sort > /tmp/opreg-out-list \
    && tar rf out.tar -T /tmp/opreg-out-list && xargs -d '\n' rm -f < /tmp/opreg-out-list \
    && find . -mindepth 1 -type d -empty -delete)
  echo "$n_out files under $OUT (a call returns at most 8): packed into out.tar"
fi
