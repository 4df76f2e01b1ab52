"""The engine: `EngineCore` (schedule -> execute -> update), its clients (a thread or a child
process), the streaming `AsyncEngine`, and the input/output processing around them."""
