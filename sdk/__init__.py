"""kvbaton: pass KV-cache handles instead of text between LLM agents."""

from .client import AsyncClient, Client, aconnect, connect
from .errors import (
    ContextTooLong,
    HandleNotFound,
    HandleReleased,
    IncompatibleHandle,
    InvalidRequest,
    KvbatonError,
    ModelNotFound,
    PoolExhausted,
    ServerUnavailable,
    Unauthorized,
)
from .handle import Handle, LineageStep, Op, Placement, Positions
from .stepgraph import StepGraph, StepGraphSpec
from .stream import AsyncTokenStream, TokenStream
from .types import AgentInfo, AgentStats, CacheStats, ChatMessage, Result, SamplingParams, Stats, StreamChunk, Timings

__version__ = "0.1.0"

__all__ = [
    "AgentInfo",
    "AgentStats",
    "CacheStats",
    "StepGraph",
    "StepGraphSpec",
    "AsyncClient",
    "AsyncTokenStream",
    "ServerUnavailable",
    "Unauthorized",
    "aconnect",
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
