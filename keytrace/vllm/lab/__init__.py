"""The CPU lab: vLLM's real scheduler, connector and managers driven on a CPU (`harness`),
and what is built on it: seeded traffic (`workload`), replays of recorded episodes
(`replay`), the isolated-lookup oracle (`oracle`), length sweeps (`sweep`), the fuzzer
(`fuzz`), the minimizer (`minimize`), the upstream report (`upstream`) and the demo. Never
loaded inside a server.

Importing any of it first sets what the lab needs from the environment
(`keytrace.vllm.lab.environment`), before any of its modules imports vLLM.
"""

from keytrace.vllm.lab import environment

environment.prepare()
