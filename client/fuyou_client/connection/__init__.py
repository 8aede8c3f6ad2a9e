"""The daemon connection: a session with fuyoud (session.py: the socket, gRPC, shared
memory), the shared buffers mapped from it (buffers.py), and a private fuyoud started
as a child process (launch.py)."""
from fuyou_client.connection.buffers import SharedBuffer
from fuyou_client.connection.launch import DaemonProcess, start_daemon, to_toml
from fuyou_client.connection.session import In, ObjectInfo, Out, Session, connect, flatten, all_of

__all__ = ["Session", "connect", "In", "Out", "ObjectInfo", "SharedBuffer", "all_of", "flatten", "start_daemon",
           "DaemonProcess", "to_toml"]
