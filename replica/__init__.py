"""A replica: EngineCore (schedule -> execute -> update), workers, model, the offline LLM API."""
