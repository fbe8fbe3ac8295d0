"""The serving core: one llama.cpp model, its KV cache, and the worker that decodes.

Reached from the service (adapter.service, request handling) and from start-up
(adapter.runtime, adapter.labels' probes, before any request); tests/test_layers.py keeps
it so. Each module owns one piece of state and says which threads may touch it:

- `vocab`: tokenizing and token pieces. Read-only after load: any thread.
- `native`: binding checks and reading the weights (start-up only).
- `engine`: the llama.cpp context and the KV cache it fills: decode, logits, copy and cut,
  reset. The scheduler's worker only (start-up probes run before the worker exists).
- `generation`: one chat stream, through the engine's narrow stream interface. Worker only.
- `layout`: where every token of a pass goes, and the one price function that says what a
  request costs. Pure: any thread (the planner's state is the engine's, worker only).
- `retry_line`: the places refused requests hold, so the refused are served in turn. Pure;
  the admission owns it.
- `admission`: who may queue and when the refused come back (room, the wait ahead, the
  retry line), the speed model, whether a request part-way through can end in time, and
  the back-pressure rule. Pure; the scheduler calls it under its queue lock and reports
  each pass to it there.
- `scheduler`: the queue (request threads submit under its lock), the worker that runs
  passes and chat steps, and the snapshot of ready work it publishes for any thread.
- `failures`: the core's failure types; the core never speaks HTTP (the service maps them
  to answers, adapter.service).
"""
