"""kvbaton: pass KV-cache handles instead of text between LLM agents."""

from .capabilities import Capabilities
from .client import AsyncClient, Client, aconnect, connect
from .errors import (
    ContextTooLong,
    HandleNotFound,
    HandleReleased,
    IncompatibleHandle,
    InvalidRequest,
    KvbatonError,
    MergeConflict,
    ModelNotFound,
    PoolExhausted,
    ServerUnavailable,
    Unauthorized,
    UnsupportedPositions,
)
from .handle import Handle, LineageStep, Op, Placement, Positions, Segment
from .stepgraph import StepGraph, StepGraphSpec
from .stream import AsyncTokenStream, TokenStream
from .types import (
    AgentInfo,
    AgentStats,
    CacheStats,
    ChatMessage,
    Composition,
    Fidelity,
    Result,
    SamplingParams,
    SegmentReport,
    Stats,
    StreamChunk,
    Timings,
)

__version__ = "0.1.0"

__all__ = [
    "AgentInfo",
    "Capabilities",
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
    "Composition",
    "Fidelity",
    "MergeConflict",
    "Segment",
    "SegmentReport",
    "UnsupportedPositions",
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
