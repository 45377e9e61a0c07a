"""Framework adapters (LangGraph, AutoGen) that put kvbaton under existing agent apps."""
