"""The CPU lab: vLLM's real scheduler, connector and managers driven on a CPU (`harness`),
and what is built on it: seeded traffic (`workload`), replays of recorded episodes
(`replay`), the isolated-lookup oracle (`oracle`), length sweeps (`sweep`), the fuzzer
(`fuzz`), the minimizer (`minimize`), the upstream report (`upstream`) and the demo. Never
loaded inside a server."""
