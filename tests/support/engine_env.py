"""How the tests start their own vLLM engines (plugin servers, offline engines), as opposed to `exl3local up`."""

# Engine core and worker in one process: vLLM's CPU default spawns a process for each, and each spawned process
# imports vLLM again (~15 s of CPU on CI). The product's `up` keeps vLLM's default (its CPU platform binds OpenMP
# threads in the worker process), and the `up` tests in tests/models and tests/daemon run it that way.
IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
