"""
pdkv native core (use the `pdkv` package, not this module)
"""
from __future__ import annotations
import collections.abc
import typing
import typing_extensions
__all__: list[str] = ['Agent', 'AgentConfig', 'AgentHooks', 'AgentMetadata', 'Blocks', 'Codec', 'CompletionQueue', 'EXTENT_COLUMNS', 'InitiatorHandshake', 'KVGeometry', 'KVLayout', 'MemKind', 'OpKind', 'Peer', 'PlanOptions', 'PreparedTransfer', 'ShmOptions', 'StreamOptions', 'StreamingWrite', 'TargetHandshake', 'TcpCompression', 'TcpOptions', 'TokenOrder', 'Transfer', 'TransportCaps', 'XferOptions', 'XferState', 'available_transports', 'bench_switches', 'buffer_info', 'codec_available', 'codec_checksum_available', 'codec_header_bytes', 'codec_kernels', 'codec_kernels_available', 'codec_peek_frame', 'decode_metadata', 'default_transports', 'dlpack_memory', 'dtype_name', 'dtype_size', 'open_stream', 'plan_blocks', 'pybind11_version', 'register_transport', 'registered_transports', 'set_codec_kernels', 'set_thread_cpus', 'status_code_names', 'thread_cpus']
class XferState:
    """
    Members:
    
      PENDING
    
      DONE
    
      FAILED
    
      CANCELLED
    """
    CANCELLED: typing.ClassVar[XferState]
    DONE: typing.ClassVar[XferState]
    FAILED: typing.ClassVar[XferState]
    PENDING: typing.ClassVar[XferState]
    __members__: typing.ClassVar[dict[str, XferState]]
    @typing.overload
    def __eq__(self, other: XferState) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: XferState) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class OpKind:
    """
    Members:
    
      WRITE
    
      READ
    """
    READ: typing.ClassVar[OpKind]
    WRITE: typing.ClassVar[OpKind]
    __members__: typing.ClassVar[dict[str, OpKind]]
    @typing.overload
    def __eq__(self, other: OpKind) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: OpKind) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class MemKind:
    """
    Members:
    
      HOST
    
      CUDA
    """
    CUDA: typing.ClassVar[MemKind]
    HOST: typing.ClassVar[MemKind]
    __members__: typing.ClassVar[dict[str, MemKind]]
    @typing.overload
    def __eq__(self, other: MemKind) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: MemKind) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class TokenOrder:
    """
    Members:
    
      NHD
    
      HND
    """
    HND: typing.ClassVar[TokenOrder]
    NHD: typing.ClassVar[TokenOrder]
    __members__: typing.ClassVar[dict[str, TokenOrder]]
    @typing.overload
    def __eq__(self, other: TokenOrder) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    def __getstate__(self) -> int:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __ne__(self, other: TokenOrder) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class KVGeometry:
    __hash__: typing.ClassVar[None] = None
    def __eq__(self, arg0: KVGeometry) -> bool:
        ...
    def __init__(self, num_layers: typing.SupportsInt | typing.SupportsIndex, num_blocks: typing.SupportsInt | typing.SupportsIndex, block_tokens: typing.SupportsInt | typing.SupportsIndex, kv_heads: typing.SupportsInt | typing.SupportsIndex, head_dim: typing.SupportsInt | typing.SupportsIndex, dtype: str, kv_parts: typing.SupportsInt | typing.SupportsIndex, order: TokenOrder) -> None:
        ...
    @property
    def block_half_bytes(self) -> int:
        ...
    @property
    def block_tokens(self) -> int:
        ...
    @property
    def dtype(self) -> str:
        ...
    @property
    def head_dim(self) -> int:
        ...
    @property
    def kv_heads(self) -> int:
        ...
    @property
    def kv_parts(self) -> int:
        ...
    @property
    def num_blocks(self) -> int:
        ...
    @property
    def num_layers(self) -> int:
        ...
    @property
    def order(self) -> TokenOrder:
        ...
class KVLayout:
    @staticmethod
    def contiguous(arg0: KVGeometry, arg1: typing.SupportsInt | typing.SupportsIndex, arg2: bool) -> KVLayout:
        ...
    @staticmethod
    def contiguous_bytes(arg0: KVGeometry) -> int:
        ...
    @staticmethod
    def make(arg0: KVGeometry, arg1: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex]]) -> KVLayout:
        ...
    @staticmethod
    def make_strided(geometry: KVGeometry, segments: collections.abc.Sequence[typing.Annotated[collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], "FixedSize(4)"]]) -> KVLayout:
        """
        segments[layer * kv_parts + part] = (addr, block_stride, token_stride, head_stride), bytes
        """
    @property
    def bound(self) -> bool:
        ...
    @property
    def end_addr(self) -> int:
        ...
    @property
    def geometry(self) -> KVGeometry:
        ...
    @property
    def min_addr(self) -> int:
        ...
    @property
    def segments(self) -> list:
        ...
class Transfer:
    def cancel(self) -> None:
        ...
    def error_info(self) -> typing.Any:
        ...
    def fail_now(self, error: typing.Any) -> None:
        """
        Fails a transfer none of whose parts was started.
        """
    def resolve_part(self, nbytes: typing.SupportsInt | typing.SupportsIndex, error: typing.Any = None) -> bool:
        """
        Resolves one part: its bytes landed, or `error` (a pdkv.PdkvError; Cancelled for a dropped part). True when this made the transfer terminal.
        """
    def set_cancel_hook(self, arg0: typing.Any) -> None:
        """
        Called (from the thread that calls cancel()) when cancellation is requested.
        """
    def set_driver(self, arg0: typing.Any) -> None:
        """
        drive(timeout_s) is called by wait() (GIL taken) to make progress itself until the transfer is terminal or timeout_s passes.
        """
    def set_parts(self, n: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        Declares how many parts will resolve (once, before any resolves).
        """
    def wait(self, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> XferState:
        ...
    @property
    def bytes_done(self) -> int:
        ...
    @property
    def bytes_total(self) -> int:
        ...
    @property
    def cancel_requested(self) -> bool:
        ...
    @property
    def compression(self) -> str:
        ...
    @property
    def elapsed_s(self) -> float:
        ...
    @property
    def id(self) -> int:
        ...
    @property
    def op(self) -> OpKind:
        ...
    @property
    def peer(self) -> str:
        ...
    @property
    def remaining_s(self) -> float:
        """
        Seconds until the transfer's deadline (inf: none; negative: passed).
        """
    @property
    def state(self) -> XferState:
        ...
    @property
    def terminal(self) -> bool:
        ...
    @property
    def transport(self) -> str:
        ...
    @property
    def wire_bytes(self) -> int:
        ...
class TransportCaps:
    """
    What a transport can do (see cpp/include/pdkv/spi/transport.h).
    """
    cross_host: bool
    direct_small_extents: bool
    generations: bool
    notify: bool
    read: bool
    serves_metadata: bool
    write: bool
    def __init__(self, *, write: bool = True, read: bool = True, notify: bool = True, cross_host: bool = True, local_mem_kinds: typing.SupportsInt | typing.SupportsIndex = 1, remote_mem_kinds: typing.SupportsInt | typing.SupportsIndex = 1, generations: bool = False, serves_metadata: bool = False, direct_small_extents: bool = False) -> None:
        ...
    @property
    def local_mem_kinds(self) -> int:
        ...
    @local_mem_kinds.setter
    def local_mem_kinds(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def remote_mem_kinds(self) -> int:
        ...
    @remote_mem_kinds.setter
    def remote_mem_kinds(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
class AgentMetadata:
    """
    A peer's decoded metadata, as a transport sees it.
    """
    def extra(self, arg0: str) -> typing.Any:
        """
        The bytes transport `name` published (metadata_extra), or None.
        """
    @property
    def endpoints(self) -> list:
        ...
    @property
    def host_id(self) -> str:
        ...
    @property
    def instance_id(self) -> int:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def pid(self) -> int:
        ...
    @property
    def regions(self) -> list:
        ...
class Peer:
    """
    A known peer: its metadata and the secret to prove knowledge of to it (never sent).
    """
    @property
    def md(self) -> AgentMetadata:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def secret(self) -> bytes:
        ...
class AgentHooks:
    """
    What a transport may ask of the agent that owns it (transport.h).
    """
    def deliver_notification(self, peer: str, data: bytes) -> None:
        ...
    def fetch_metadata(self, address: str, secret: bytes, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> bytes:
        ...
    def metadata_blob(self) -> bytes:
        ...
    def regions(self) -> list:
        ...
    @property
    def accepted_secrets(self) -> list:
        """
        Every secret this agent accepts, its own first (derive keys from them; never send them).
        """
    @property
    def agent_name(self) -> str:
        ...
    @property
    def host_id(self) -> str:
        ...
    @property
    def instance_id(self) -> int:
        ...
    @property
    def max_notif_bytes(self) -> int:
        ...
class PreparedTransfer:
    @property
    def bytes(self) -> int:
        ...
    @property
    def checked(self) -> bool:
        ...
    @property
    def num_extents(self) -> int:
        ...
    @property
    def op(self) -> OpKind:
        ...
    @property
    def peer(self) -> str:
        ...
    @property
    def transport(self) -> str:
        ...
class TcpCompression:
    """
    Compression of tcp writes and reads (docs/compression.md, 'On the wire'). Off by default; a transfer may override the mode (compress=).
    """
    __hash__: typing.ClassVar[None] = None
    def __copy__(self) -> TcpCompression:
        ...
    def __deepcopy__(self, memo: typing.Any) -> TcpCompression:
        ...
    def __eq__(self, arg0: typing.Any) -> bool:
        ...
    def __getstate__(self) -> dict:
        ...
    def __init__(self, *, mode: str = 'off', policy: str = 'lossless', codec: str = 'zstd', level: int = 1, checksum: bool = False, chunk_bytes: int = 1048576, threads: int = 0, dtype: str = 'bfloat16', fp8_heads: int = 1, fp8_head_dim: int = 64, fp8_rows_per_group: int = 16) -> None:
        """
        Keyword arguments are the attributes (defaults shown); validates at once.
        """
    def __repr__(self) -> str:
        ...
    def __setstate__(self, arg0: dict) -> None:
        ...
    def validate(self) -> None:
        """
        Raises InvalidArgument naming the first field out of range (constructors call it; call it again after changing attributes, or let Agent() do it).
        """
    @property
    def checksum(self) -> typing.Any:
        """
        bool: XXH3-64 of every chunk's uncompressed bytes, verified by the receiver (DataCorrupted).
        """
    @checksum.setter
    def checksum(self, value: bool) -> None:
        ...
    @property
    def chunk_bytes(self) -> int:
        """
        int, bytes (4096..2**26): raw bytes per codec frame, the pipeline unit (chunk i+1 is encoded while chunk i is on the wire).
        """
    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        ...
    @property
    def codec(self) -> typing.Any:
        """
        str: the lossless codec, 'zstd' or 'lz4'.
        """
    @codec.setter
    def codec(self, value: str) -> None:
        ...
    @property
    def dtype(self) -> typing.Any:
        """
        str: element type of the KV sent ('bfloat16', 'float16', 'float32', ...): byte planes, fp8.
        """
    @dtype.setter
    def dtype(self, value: str) -> None:
        ...
    @property
    def fp8_head_dim(self) -> typing.Any:
        """
        int: elements per head.
        """
    @fp8_head_dim.setter
    def fp8_head_dim(self, value: int) -> None:
        ...
    @property
    def fp8_heads(self) -> typing.Any:
        """
        int: fp8 rows are fp8_heads x fp8_head_dim elements.
        """
    @fp8_heads.setter
    def fp8_heads(self, value: int) -> None:
        ...
    @property
    def fp8_rows_per_group(self) -> typing.Any:
        """
        int: rows per fp8 scale (tokens per block: per-block-per-head scales).
        """
    @fp8_rows_per_group.setter
    def fp8_rows_per_group(self, value: int) -> None:
        ...
    @property
    def level(self) -> typing.Any:
        """
        int (-7..9): zstd level (1: fast; negative: faster still).
        """
    @level.setter
    def level(self, value: int) -> None:
        ...
    @property
    def mode(self) -> typing.Any:
        """
        str: 'off', 'lossless' (bit-exact), 'fp8' (lossy, opt-in) or 'auto' (per peer and direction, from the measured link and codec throughput; see policy).
        """
    @mode.setter
    def mode(self, value: str) -> None:
        ...
    @property
    def policy(self) -> typing.Any:
        """
        str: what mode 'auto' may choose besides plain: 'lossless' or 'lossy-allowed' (fp8).
        """
    @policy.setter
    def policy(self, value: str) -> None:
        ...
    @property
    def threads(self) -> int:
        """
        int (0..16): encoder threads per agent (0: min(4, hardware threads)).
        """
    @threads.setter
    def threads(self, value: int) -> None:
        ...
class PlanOptions:
    """
    What a block transfer moves of layouts of different shape (block size, NHD/HND, a tensor-parallel head split) and which layers: pdkv/kv_layout.h. 0 means 'all'.
    """
    __hash__: typing.ClassVar[None] = None
    def __copy__(self) -> PlanOptions:
        ...
    def __deepcopy__(self, memo: typing.Any) -> PlanOptions:
        ...
    def __eq__(self, arg0: typing.Any) -> bool:
        ...
    def __getstate__(self) -> dict:
        ...
    def __init__(self, *, num_tokens: int = 0, num_heads: int = 0, local_head_offset: int = 0, remote_head_offset: int = 0, first_layer: int = 0, num_layers: int = 0) -> None:
        """
        Keyword arguments are the attributes (defaults shown); validates at once.
        """
    def __repr__(self) -> str:
        ...
    def __setstate__(self, arg0: dict) -> None:
        ...
    def validate(self) -> None:
        """
        Raises InvalidArgument naming the first field out of range (constructors call it; call it again after changing attributes, or let Agent() do it).
        """
    @property
    def first_layer(self) -> int:
        """
        int: first layer moved; the layers are [first_layer, first_layer + num_layers). A range beyond the layouts' layers raises OutOfRange.
        """
    @first_layer.setter
    def first_layer(self, value: int) -> None:
        ...
    @property
    def local_head_offset(self) -> int:
        """
        int: first head moved on this agent's side (tensor-parallel splits).
        """
    @local_head_offset.setter
    def local_head_offset(self, value: int) -> None:
        ...
    @property
    def num_heads(self) -> int:
        """
        int: kv heads to move; 0: all, accepted only when both layouts hold the same number of kv heads.
        """
    @num_heads.setter
    def num_heads(self, value: int) -> None:
        ...
    @property
    def num_layers(self) -> int:
        """
        int: layers moved; 0: every layer from first_layer on.
        """
    @num_layers.setter
    def num_layers(self, value: int) -> None:
        ...
    @property
    def num_tokens(self) -> int:
        """
        int: tokens to move, counted from the start of the first block; 0: all of them, accepted only when both block lists hold the same number of tokens (a plan never moves part of the data unless asked).
        """
    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        ...
    @property
    def remote_head_offset(self) -> int:
        """
        int: first head moved on the peer's side.
        """
    @remote_head_offset.setter
    def remote_head_offset(self, value: int) -> None:
        ...
class XferOptions:
    """
    How a transfer travels: pdkv/agent.h.
    """
    __hash__: typing.ClassVar[None] = None
    def __copy__(self) -> XferOptions:
        ...
    def __deepcopy__(self, memo: typing.Any) -> XferOptions:
        ...
    def __eq__(self, arg0: typing.Any) -> bool:
        ...
    def __getstate__(self) -> dict:
        ...
    def __init__(self, *, transport: str | None = None, compress: str | None = None) -> None:
        """
        Keyword arguments are the attributes (defaults shown); validates at once.
        """
    def __repr__(self) -> str:
        ...
    def __setstate__(self, arg0: dict) -> None:
        ...
    def validate(self) -> None:
        """
        Raises InvalidArgument naming the first field out of range (constructors call it; call it again after changing attributes, or let Agent() do it).
        """
    @property
    def compress(self) -> typing.Any:
        """
        str or None: how this transfer's payload travels on a tcp wire, overriding the agent's TcpOptions.compress.mode for it only ('off', 'lossless', 'fp8', 'auto'; its codec, dtype and fp8 grouping apply as they are); None: the agent's mode. 'fp8' (or 'auto' with policy 'lossy-allowed') allows lossy KV for this transfer; reads ask the peer for compressed responses. Other transports move the bytes exactly (docs/compression.md).
        """
    @compress.setter
    def compress(self, value: str | None) -> None:
        ...
    @property
    def transport(self) -> typing.Any:
        """
        str or None: the transport to use ('tcp', 'shm', ...; it must reach the peer); None: the peer's (Agent.peer_transport).
        """
    @transport.setter
    def transport(self, value: str | None) -> None:
        ...
class StreamOptions:
    """
    How a layer-wise stream batches its layers: pdkv/stream.h.
    """
    __hash__: typing.ClassVar[None] = None
    def __copy__(self) -> StreamOptions:
        ...
    def __deepcopy__(self, memo: typing.Any) -> StreamOptions:
        ...
    def __eq__(self, arg0: typing.Any) -> bool:
        ...
    def __getstate__(self) -> dict:
        ...
    def __init__(self, *, min_batch_bytes: int = 0, max_inflight_batches: int = 4, progress_prefix: bytes = b'') -> None:
        """
        Keyword arguments are the attributes (defaults shown); validates at once.
        """
    def __repr__(self) -> str:
        ...
    def __setstate__(self, arg0: dict) -> None:
        ...
    def validate(self) -> None:
        """
        Raises InvalidArgument naming the first field out of range (constructors call it; call it again after changing attributes, or let Agent() do it).
        """
    @property
    def max_inflight_batches(self) -> int:
        """
        int (>= 1): most transfers of the stream in flight; layers posted meanwhile leave together when one completes.
        """
    @max_inflight_batches.setter
    def max_inflight_batches(self, value: int) -> None:
        ...
    @property
    def min_batch_bytes(self) -> int:
        """
        int, bytes: posted layers holding fewer bytes than this wait for more (or for close); 0: send whatever is ready.
        """
    @min_batch_bytes.setter
    def min_batch_bytes(self, value: int) -> None:
        ...
    @property
    def progress_prefix(self) -> typing.Any:
        """
        bytes (str: UTF-8): when not empty, every batch also delivers the notification progress_prefix + b'<first>-<end>' (its layer range) once it landed, for a receiver that starts on early layers.
        """
    @progress_prefix.setter
    def progress_prefix(self, value: bytes) -> None:
        ...
class TcpOptions:
    """
    Options of the tcp transport (any host). Units are in the names.
    """
    __hash__: typing.ClassVar[None] = None
    transport: typing.ClassVar[str] = 'tcp'
    def __copy__(self) -> TcpOptions:
        ...
    def __deepcopy__(self, memo: typing.Any) -> TcpOptions:
        ...
    def __eq__(self, arg0: typing.Any) -> bool:
        ...
    def __getstate__(self) -> dict:
        ...
    def __init__(self, *, listen_host: str = '127.0.0.1', listen_port: int = 0, conns_per_peer: int = 1, progress_threads: int = 1, spin_us: int = 0, batch_bytes: int = 16777216, batch_extents: int = 1020, rcvlowat_bytes: int = 1048576, connect_timeout_s: float = 5.0, tls: bool = False, handshake_timeout_s: float = 5.0, frame_timeout_s: float = 30.0, stage_chunk_bytes: int = 4194304, stage_buffers: int = 4, max_inbound_conns: int = 1024, max_inbound_per_peer: int = 128, compress: TcpCompression = ..., gather_below_bytes: int = 4096, land_below_bytes: int = 8192, congestion_control: str = '') -> None:
        """
        Keyword arguments are the attributes (defaults shown); validates at once.
        """
    def __repr__(self) -> str:
        ...
    def __setstate__(self, arg0: dict) -> None:
        ...
    def validate(self) -> None:
        """
        Raises InvalidArgument naming the first field out of range (constructors call it; call it again after changing attributes, or let Agent() do it).
        """
    @property
    def batch_bytes(self) -> int:
        """
        int, bytes (1..2**30): max payload per wire batch.
        """
    @batch_bytes.setter
    def batch_bytes(self, value: int) -> None:
        ...
    @property
    def batch_extents(self) -> int:
        """
        int (1..1020): max extents per batch (one sendmsg, bounded by IOV_MAX).
        """
    @batch_extents.setter
    def batch_extents(self, value: int) -> None:
        ...
    @property
    def compress(self) -> TcpCompression:
        """
        TcpCompression: compression of writes and reads (off by default).
        """
    @compress.setter
    def compress(self, value: TcpCompression) -> None:
        ...
    @property
    def congestion_control(self) -> str:
        """
        str: TCP congestion control of every connection this agent opens or accepts ("cubic", "reno", "bbr", ...); "" keeps the system's. On a host whose default is bbr, loopback transfers measured ~30% faster with cubic or reno (docs/benchmarks.md). A name the kernel refuses fails the agent's start, naming what is allowed.
        """
    @congestion_control.setter
    def congestion_control(self, value: str) -> None:
        ...
    @property
    def connect_timeout_s(self) -> float:
        """
        float, seconds (0, 86400]: TCP connect plus handshake.
        """
    @connect_timeout_s.setter
    def connect_timeout_s(self, value: float) -> None:
        ...
    @property
    def conns_per_peer(self) -> int:
        """
        int (1..64): parallel connections to each peer; batches are spread over them.
        """
    @conns_per_peer.setter
    def conns_per_peer(self, value: int) -> None:
        ...
    @property
    def frame_timeout_s(self) -> float:
        """
        float, seconds (0, 86400]: a frame that stops arriving half-way, or output the peer stops reading, closes that connection after this long without progress (releasing its regions).
        """
    @frame_timeout_s.setter
    def frame_timeout_s(self, value: float) -> None:
        ...
    @property
    def gather_below_bytes(self) -> int:
        """
        int, bytes (0..2**30): a batch whose extents average fewer bytes is gathered by the sender into staging chunks and sent as one segment (0: never). Measurements: docs/transports.md.
        """
    @gather_below_bytes.setter
    def gather_below_bytes(self, value: int) -> None:
        ...
    @property
    def handshake_timeout_s(self) -> float:
        """
        float, seconds (0, 86400]: inbound connections that do not authenticate within this are closed.
        """
    @handshake_timeout_s.setter
    def handshake_timeout_s(self, value: float) -> None:
        ...
    @property
    def land_below_bytes(self) -> int:
        """
        int, bytes (0..2**30): a payload whose extents average fewer bytes is landed by the receiver in a buffer, then scattered with streaming stores (0: never).
        """
    @land_below_bytes.setter
    def land_below_bytes(self, value: int) -> None:
        ...
    @property
    def listen_host(self) -> str:
        """
        str: address to bind and publish (Agent(listen='host:port') sets it).
        """
    @listen_host.setter
    def listen_host(self, value: str) -> None:
        ...
    @property
    def listen_port(self) -> int:
        """
        int: port to bind; 0 picks a free one.
        """
    @listen_port.setter
    def listen_port(self, value: int) -> None:
        ...
    @property
    def max_inbound_conns(self) -> int:
        """
        int (1..65536): inbound connections open at once, authenticated or not; one more is refused at accept with ResourceExhausted.
        """
    @max_inbound_conns.setter
    def max_inbound_conns(self, value: int) -> None:
        ...
    @property
    def max_inbound_per_peer(self) -> int:
        """
        int (1..65536): inbound connections one authenticated peer (agent name) may hold; one more is refused with ResourceExhausted naming the peer (its first request fails with it).
        """
    @max_inbound_per_peer.setter
    def max_inbound_per_peer(self, value: int) -> None:
        ...
    @property
    def progress_threads(self) -> int:
        """
        int (1..64): native epoll threads; connections are spread over them.
        """
    @progress_threads.setter
    def progress_threads(self, value: int) -> None:
        ...
    @property
    def rcvlowat_bytes(self) -> int:
        """
        int, bytes: receiver SO_RCVLOWAT cap while a large payload arrives (0 disables).
        """
    @rcvlowat_bytes.setter
    def rcvlowat_bytes(self, value: int) -> None:
        ...
    @property
    def spin_us(self) -> int:
        """
        int, microseconds: progress threads poll this long after activity before sleeping. Off by default: on small machines a spinning thread competes with the peer and the waiter.
        """
    @spin_us.setter
    def spin_us(self, value: int) -> None:
        ...
    @property
    def stage_buffers(self) -> int:
        """
        int (2..1024): pinned chunks per agent for sending device memory (allocated on first use); each connection receiving into device memory holds two more.
        """
    @stage_buffers.setter
    def stage_buffers(self, value: int) -> None:
        ...
    @property
    def stage_chunk_bytes(self) -> int:
        """
        int, bytes (4096..2**30): device memory travels through pinned host chunks of this size, also the batch size of device transfers.
        """
    @stage_chunk_bytes.setter
    def stage_chunk_bytes(self, value: int) -> None:
        ...
    @property
    def tls(self) -> bool:
        """
        bool: encrypt every connection with TLS 1.3; the handshake inside is bound to the session. Every agent of a cluster must agree (an agent with it on speaks only TLS). Off by default.
        """
    @tls.setter
    def tls(self, value: bool) -> None:
        ...
class ShmOptions:
    """
    Options of the shm transport (same host, one copy).
    """
    __hash__: typing.ClassVar[None] = None
    transport: typing.ClassVar[str] = 'shm'
    def __copy__(self) -> ShmOptions:
        ...
    def __deepcopy__(self, memo: typing.Any) -> ShmOptions:
        ...
    def __eq__(self, arg0: typing.Any) -> bool:
        ...
    def __getstate__(self) -> dict:
        ...
    def __init__(self, *, copy_threads: int = 1, inline_bytes: int = 262144, share_pages_min_bytes: int = 1048576, notify_on_send: bool = False, allowed_peer_uids: list[int] = [], connect_timeout_s: float = 5.0) -> None:
        """
        Keyword arguments are the attributes (defaults shown); validates at once.
        """
    def __repr__(self) -> str:
        ...
    def __setstate__(self, arg0: dict) -> None:
        ...
    def validate(self) -> None:
        """
        Raises InvalidArgument naming the first field out of range (constructors call it; call it again after changing attributes, or let Agent() do it).
        """
    @property
    def allowed_peer_uids(self) -> list[int]:
        """
        list[int] (at most 64): uids besides this process's own whose processes may be shm peers, in either direction; the kernel says who the peer is (SO_PEERCRED). Empty: same uid only.
        """
    @allowed_peer_uids.setter
    def allowed_peer_uids(self, value: list[int]) -> None:
        ...
    @property
    def connect_timeout_s(self) -> float:
        """
        float, seconds (0, 86400]: dialing a same-host peer's control socket plus its handshake.
        """
    @connect_timeout_s.setter
    def connect_timeout_s(self, value: float) -> None:
        ...
    @property
    def copy_threads(self) -> int:
        """
        int (1..64): threads that copy large transfers.
        """
    @copy_threads.setter
    def copy_threads(self, value: int) -> None:
        ...
    @property
    def inline_bytes(self) -> int:
        """
        int, bytes: transfers up to this size are copied by the posting thread itself (lowest latency); larger ones go to the copy threads (post returns at once).
        """
    @inline_bytes.setter
    def inline_bytes(self, value: int) -> None:
        ...
    @property
    def notify_on_send(self) -> typing.Any:
        """
        bool: a transfer's notification completes it once sent (after every byte landed) instead of on the peer's acknowledgement; one never acknowledged is counted in Agent.notifications_unacknowledged and logged, not raised (docs/api.md, Notifications).
        """
    @notify_on_send.setter
    def notify_on_send(self, value: bool) -> None:
        ...
    @property
    def share_pages_min_bytes(self) -> int:
        """
        int, bytes: exported host memory registered from the engine (numpy, torch) whose whole pages span at least this much is re-mapped onto shareable memory at registration, so same-host peers copy into it as into Agent.alloc memory; 0 turns it off (cross-memory attach).
        """
    @share_pages_min_bytes.setter
    def share_pages_min_bytes(self, value: int) -> None:
        ...
class AgentConfig:
    """
    Everything an agent is created with (pdkv/config.h).
    """
    __hash__: typing.ClassVar[None] = None
    def __copy__(self) -> AgentConfig:
        ...
    def __deepcopy__(self, memo: typing.Any) -> AgentConfig:
        ...
    def __eq__(self, arg0: typing.Any) -> bool:
        ...
    def __getstate__(self) -> dict:
        ...
    def __init__(self, *, name: str = '', secret: bytes = b'', accepted_secrets: list[bytes] = [], transports: list[str] = ['tcp'], options: list[typing.Any] = [], default_timeout_s: float = 60.0, max_notif_bytes: int = 1048576, max_queued_notifs: int = 65536, max_queued_notif_bytes: int = 67108864, wait_spin_us: int = 50) -> None:
        """
        Keyword arguments are the attributes (defaults shown); validates at once.
        """
    def __repr__(self) -> str:
        ...
    def __setstate__(self, arg0: dict) -> None:
        ...
    def validate(self) -> None:
        """
        Raises InvalidArgument naming the first field out of range (constructors call it; call it again after changing attributes, or let Agent() do it).
        """
    @property
    def accepted_secrets(self) -> typing.Any:
        """
        list[bytes] (at most 7, each 1..1024 bytes): further secrets whose proofs this agent accepts (rotation: docs/security.md).
        """
    @accepted_secrets.setter
    def accepted_secrets(self, value: list[bytes]) -> None:
        ...
    @property
    def default_timeout_s(self) -> float:
        """
        float, seconds (>= 0): deadline of transfers posted without one (0: none).
        """
    @default_timeout_s.setter
    def default_timeout_s(self, value: float) -> None:
        ...
    @property
    def max_notif_bytes(self) -> int:
        """
        int, bytes (>= 1): largest notification sent or received.
        """
    @max_notif_bytes.setter
    def max_notif_bytes(self, value: int) -> None:
        ...
    @property
    def max_queued_notif_bytes(self) -> int:
        """
        int, bytes (>= 1): payload and sender-name bytes of the notifications not yet taken; one more that does not fit is refused as above (an empty queue takes any one).
        """
    @max_queued_notif_bytes.setter
    def max_queued_notif_bytes(self, value: int) -> None:
        ...
    @property
    def max_queued_notifs(self) -> int:
        """
        int (>= 1): received notifications not yet taken by the application; one more is refused before it is accepted (the sender's transfer fails with ResourceExhausted).
        """
    @max_queued_notifs.setter
    def max_queued_notifs(self, value: int) -> None:
        ...
    @property
    def name(self) -> str:
        """
        str: unique among peers; printable ASCII, no spaces.
        """
    @name.setter
    def name(self, value: str) -> None:
        ...
    @property
    def options(self) -> typing.Any:
        """
        list: options of transports, at most one per transport (TcpOptions(...), ShmOptions(...), a Python transport's options); a transport without any gets its defaults. The getter returns copies.
        """
    @options.setter
    def options(self, value: list[typing.Any]) -> None:
        ...
    @property
    def secret(self) -> typing.Any:
        """
        bytes (at most 1024): the cluster secret this agent proves knowledge of in every handshake (never sent); empty: a random one.
        """
    @secret.setter
    def secret(self, value: bytes) -> None:
        ...
    @property
    def transports(self) -> list[str]:
        """
        list[str]: native transports in order of preference.
        """
    @transports.setter
    def transports(self, value: list[str]) -> None:
        ...
    @property
    def wait_spin_us(self) -> int:
        """
        int, microseconds: Transfer.wait spins this long before sleeping.
        """
    @wait_spin_us.setter
    def wait_spin_us(self, value: int) -> None:
        ...
class Blocks:
    """
    One side of a block transfer: blocks of a KV layout, by id (pdkv/agent.h). Immutable.
    """
    def __copy__(self) -> Blocks:
        ...
    def __deepcopy__(self, memo: typing.Any) -> Blocks:
        ...
    def __eq__(self, arg0: typing.Any) -> bool:
        ...
    def __getstate__(self) -> tuple[str, list[int], typing.Any]:
        ...
    def __hash__(self) -> int:
        ...
    def __init__(self, layout: str, ids: typing.Any, *, generations: typing.Any = None) -> None:
        """
        layout: a layout name (this agent's on the local side, the peer's on the remote side). ids: block ids, integers only (a numpy integer array, a list, a range); position i on one side maps to position i on the other. generations: the owner's generations of these blocks (Agent.generations), one per id, as the owner handed them out with the ids; only the remote side's are checked: every post then has the peer check them before any byte lands (write) or is sent (read), and a block freed or reused since fails the transfer with StaleBlock (docs/generations.md). tcp and shm only. Validates at once (InvalidArgument naming the field; OutOfRange for ids beyond 32 bits).
        """
    def __len__(self) -> int:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, arg0: tuple) -> None:
        ...
    @property
    def generations(self) -> typing.Any:
        """
        list[int] or None: the owner's generations of the blocks (None: unchecked).
        """
    @property
    def ids(self) -> list[int]:
        """
        list[int]: the block ids.
        """
    @property
    def layout(self) -> str:
        """
        str: the layout's name.
        """
class CompletionQueue:
    """
    Wakes one asyncio event loop when watched transfers finish (see Transfer.wait_async).
    """
    def __init__(self) -> None:
        ...
    def take(self) -> list[int]:
        """
        Tickets of the watched transfers finished since the last call.
        """
    def watch(self, transfer: Transfer) -> int:
        """
        A ticket that take() returns once the transfer is terminal.
        """
    @property
    def fd(self) -> int:
        """
        eventfd, readable while finished tickets are queued.
        """
class Agent:
    def __init__(self, config: AgentConfig) -> None:
        """
        Validates `config` and starts the agent's transports.
        """
    def add_layout(self, arg0: str, arg1: KVLayout) -> None:
        ...
    def add_peer(self, blob: bytes, secret: bytes, transport: str, via_host: str = '') -> str:
        ...
    def bump_generations(self, arg0: str, arg1: typing.Any, arg2: typing.SupportsFloat | typing.SupportsIndex) -> list[int]:
        ...
    def connect(self, arg0: str, arg1: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    def deregister_memory(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def fetch_metadata(self, arg0: str, arg1: bytes, arg2: typing.SupportsFloat | typing.SupportsIndex) -> bytes:
        ...
    def generations(self, arg0: str, arg1: typing.Any) -> list[int]:
        ...
    def layout(self, arg0: str) -> KVLayout:
        ...
    def layout_names(self) -> list[str]:
        ...
    def metadata(self) -> bytes:
        ...
    def peer_metadata(self, arg0: str) -> bytes:
        ...
    def peer_names(self) -> list[str]:
        ...
    def peer_transport(self, arg0: str) -> str:
        ...
    def post(self, arg0: PreparedTransfer, arg1: bytes, arg2: typing.SupportsFloat | typing.SupportsIndex) -> Transfer:
        ...
    def prepare_blocks(self, peer: str, op: OpKind, local: Blocks, remote: Blocks, plan: PlanOptions, options: XferOptions) -> PreparedTransfer:
        ...
    def prepare_extents(self, peer: str, op: OpKind, extents: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex]], options: XferOptions) -> PreparedTransfer:
        ...
    def regions(self) -> list:
        ...
    def register_memory(self, addr: typing.SupportsInt | typing.SupportsIndex, len: typing.SupportsInt | typing.SupportsIndex, kind: MemKind, device: typing.SupportsInt | typing.SupportsIndex, remote_access: bool, shm_fd: typing.SupportsInt | typing.SupportsIndex = -1) -> dict:
        ...
    def remove_layout(self, arg0: str) -> None:
        ...
    def remove_peer(self, arg0: str) -> None:
        ...
    def send_notification(self, arg0: str, arg1: bytes, arg2: typing.SupportsFloat | typing.SupportsIndex) -> Transfer:
        ...
    def take_notifications(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> list:
        ...
    def wait_notifications(self, arg0: typing.SupportsFloat | typing.SupportsIndex, arg1: typing.SupportsInt | typing.SupportsIndex) -> list:
        ...
    @property
    def endpoints(self) -> list:
        ...
    @property
    def instance_id(self) -> int:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def notification_fd(self) -> int:
        ...
    @property
    def notifications_unacknowledged(self) -> int:
        ...
    @property
    def secret(self) -> bytes:
        ...
    @property
    def transports(self) -> list[str]:
        ...
class StreamingWrite:
    def cancel(self) -> None:
        ...
    def close(self, notif: bytes | None = None) -> None:
        ...
    def post_layers(self, first: typing.SupportsInt | typing.SupportsIndex, count: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def batches_posted(self) -> int:
        ...
    @property
    def closed(self) -> bool:
        ...
    @property
    def first_layer(self) -> int:
        ...
    @property
    def layer_bytes(self) -> int:
        ...
    @property
    def layers_landed(self) -> int:
        ...
    @property
    def layers_posted(self) -> int:
        ...
    @property
    def num_layers(self) -> int:
        ...
    @property
    def tail_s(self) -> float:
        ...
    @property
    def transfer(self) -> Transfer:
        ...
    @property
    def wire_s(self) -> float:
        ...
class Codec:
    def __init__(self, kind: str, level: typing.SupportsInt | typing.SupportsIndex = 1, checksum: bool = False, heads: typing.SupportsInt | typing.SupportsIndex = 1, head_dim: typing.SupportsInt | typing.SupportsIndex = 1, rows_per_group: typing.SupportsInt | typing.SupportsIndex = 128) -> None:
        ...
    def decode(self, frame: typing_extensions.Buffer, dtype: str = '') -> bytes:
        ...
    def decode_into(self, frame: typing_extensions.Buffer, out: typing_extensions.Buffer, dtype: str) -> int:
        ...
    def encode(self, src: typing_extensions.Buffer, dtype: str) -> bytes:
        ...
    def max_frame_size(self, arg0: typing.SupportsInt | typing.SupportsIndex, arg1: str) -> int:
        ...
    def throughput(self, src: typing_extensions.Buffer, dtype: str, out_dtype: str = '', repeats: typing.SupportsInt | typing.SupportsIndex = 3) -> dict:
        ...
    @property
    def checksum(self) -> bool:
        ...
    @property
    def kind(self) -> str:
        ...
class InitiatorHandshake:
    """
    The initiator's half of one handshake (pdkv/spi/auth.h).
    """
    def __init__(self, transport: str, version: typing.SupportsInt | typing.SupportsIndex, self_name: str) -> None:
        ...
    def answer(self, target: str, target_instance: typing.SupportsInt | typing.SupportsIndex, nonce: bytes, pub: bytes, secret: bytes) -> bytes:
        """
        The target's challenge -> our proof (32 bytes), made with `secret`.
        """
    def check_accept(self, mac: bytes) -> None:
        """
        AuthFailed unless `mac` is the target's MAC under the secret we proved.
        """
    @property
    def nonce(self) -> bytes:
        ...
    @property
    def pub(self) -> bytes:
        ...
class TargetHandshake:
    """
    The target's half of one handshake (pdkv/spi/auth.h).
    """
    def __init__(self, transport: str, version: typing.SupportsInt | typing.SupportsIndex, initiator: str, self_name: str, self_instance: typing.SupportsInt | typing.SupportsIndex, nonce: bytes, pub: bytes) -> None:
        ...
    def check(self, proof: bytes, secrets: collections.abc.Sequence[str]) -> tuple[int, bytes]:
        """
        (index of the secret the initiator proved, our MAC to send back), or AuthFailed.
        """
    @property
    def nonce(self) -> bytes:
        ...
    @property
    def pub(self) -> bytes:
        ...
def available_transports() -> list[str]:
    ...
def bench_switches() -> list:
    """
    The benchmark switches (cpp/src/util/bench_switches.h): dicts of name, values, meaning, default and the value in force ('' when unset), read once per process.
    """
def buffer_info(arg0: typing.Any) -> tuple[int, int, bool, bool]:
    ...
def codec_available(arg0: str) -> bool:
    ...
def codec_checksum_available() -> bool:
    ...
def codec_kernels() -> str:
    ...
def codec_kernels_available() -> list:
    ...
def codec_peek_frame(arg0: typing_extensions.Buffer) -> dict:
    ...
def decode_metadata(arg0: bytes) -> dict:
    ...
def default_transports() -> list[str]:
    ...
def dlpack_memory(obj: typing.Any) -> tuple[int, int, str, int, bool, tuple[typing_extensions.CapsuleType, typing.Any]]:
    """
    (addr, nbytes, kind, device, readonly, keepalive) of a DLPack exporter's memory; InvalidArgument when it is not contiguous, empty, or on a device other than CPU or CUDA. Keep `keepalive` while the memory is in use.
    """
def dtype_name(arg0: str) -> str:
    ...
def dtype_size(arg0: str) -> int:
    ...
def open_stream(agent: Agent, peer: str, local: Blocks, remote: Blocks, plan: PlanOptions, options: XferOptions, notif: bytes, timeout_s: typing.SupportsFloat | typing.SupportsIndex, stream: StreamOptions) -> StreamingWrite:
    """
    Opens a layer-wise streaming write (Agent::open_stream); python/pdkv/agent.py documents it.
    """
def plan_blocks(local: KVLayout, local_ids: typing.Any, remote: KVLayout, remote_ids: typing.Any, plan: typing.Any = None, distinct: str = '') -> list:
    ...
def register_transport(name: str, description: str, priority: typing.Any, viable: typing.Any, create: typing.Any, metadata_via: str = '', options: typing.Any = None) -> None:
    ...
def registered_transports() -> list[str]:
    ...
def set_codec_kernels(name: str) -> None:
    ...
def set_thread_cpus(arg0: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None:
    ...
def status_code_names() -> list[str]:
    ...
def thread_cpus() -> list[int]:
    ...
EXTENT_COLUMNS: tuple = ('local_addr', 'len', 'local_kind', 'local_device', 'remote_region', 'remote_offset', 'remote_addr')
codec_header_bytes: int = 48
pybind11_version: str = '3.1.0'
