"""The `specexec` command (`python -m specexec`): dispatches to the engine (generate), the server
(serve), the benchmarks (bench/) and the pair builder (builder/)."""
