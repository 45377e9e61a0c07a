"""kvbaton: pass KV-cache handles instead of text between LLM agents."""

from .capabilities import Capabilities
from .client import AsyncClient, Client
from .connect import aconnect, connect
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
from .ops import KVOps
from .stepgraph import StepGraph, StepGraphSpec
from .stream import AsyncTokenStream, TokenStream
from .types import (
    AgentInfo,
    AgentStats,
    CacheStats,
    ChatMessage,
    Composition,
    Event,
    Events,
    Fidelity,
    ResponseFormat,
    Result,
    Reuse,
    SamplingParams,
    SegmentReport,
    Stats,
    StreamChunk,
    Timings,
    TokenLogprob,
    TopLogprob,
)

__version__ = "0.1.0"

__all__ = [
    "AgentInfo",
    "AgentStats",
    "AsyncClient",
    "AsyncTokenStream",
    "CacheStats",
    "Capabilities",
    "ChatMessage",
    "Client",
    "Composition",
    "ContextTooLong",
    "Event",
    "Events",
    "Fidelity",
    "Handle",
    "HandleNotFound",
    "HandleReleased",
    "IncompatibleHandle",
    "InvalidRequest",
    "KVOps",
    "KvbatonError",
    "LineageStep",
    "MergeConflict",
    "ModelNotFound",
    "Op",
    "Placement",
    "PoolExhausted",
    "Positions",
    "ResponseFormat",
    "Result",
    "Reuse",
    "SamplingParams",
    "Segment",
    "SegmentReport",
    "ServerUnavailable",
    "Stats",
    "StepGraph",
    "StepGraphSpec",
    "StreamChunk",
    "Timings",
    "TokenLogprob",
    "TokenStream",
    "TopLogprob",
    "Unauthorized",
    "UnsupportedPositions",
    "aconnect",
    "connect",
]
