"""The engine core behind the HTTP face: in its own process (core_process, driven by
core_client over ZeroMQ) or on a thread (async_engine), several of them placed by
data_parallel, all behind the EngineClient the routes talk to."""
