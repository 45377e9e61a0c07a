"""kvbaton: pass KV-cache handles instead of text between LLM agents."""

from .client import Client, connect
from .errors import (
    ContextTooLong,
    HandleNotFound,
    HandleReleased,
    IncompatibleHandle,
    InvalidRequest,
    KvbatonError,
    ModelNotFound,
    PoolExhausted,
)
from .handle import Handle, LineageStep, Op, Placement, Positions
from .stepgraph import StepGraph, StepGraphSpec
from .stream import TokenStream
from .types import AgentInfo, AgentStats, CacheStats, ChatMessage, Result, SamplingParams, Stats, StreamChunk, Timings

__version__ = "0.1.0"

__all__ = [
    "AgentInfo",
    "AgentStats",
    "CacheStats",
    "StepGraph",
    "StepGraphSpec",
    "ChatMessage",
    "Client",
    "ContextTooLong",
    "Handle",
    "HandleNotFound",
    "HandleReleased",
    "IncompatibleHandle",
    "InvalidRequest",
    "KvbatonError",
    "LineageStep",
    "ModelNotFound",
    "Op",
    "Placement",
    "PoolExhausted",
    "Positions",
    "Result",
    "SamplingParams",
    "Stats",
    "StreamChunk",
    "Timings",
    "TokenStream",
    "connect",
]
