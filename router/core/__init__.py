"""The router's engine core: the scheduler, KV accounting and the pipeline driver, in a loop
that does nothing else (`engine_core.EngineCore`), run in its own process
(`process.run_core`) and connected to the router's fronts by a compact per-step channel
(`channel`, `messages`). Imports no grpc servicer, tokenizer or detokenizer.
"""
