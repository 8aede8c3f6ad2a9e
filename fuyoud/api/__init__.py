"""The gRPC servicers: the data plane (``FuyouServicer``, with its checkpoint methods),
the operator's service (``FuyouAdminServicer``), the wrapper every method goes through and
the parts the methods work on (``Services``), and the interceptor that answers a
malformed request."""
from fuyoud.api.admin import FuyouAdminServicer
from fuyoud.api.handler import Admission, AdminAuth, Services
from fuyoud.api.malformed import MalformedRequests
from fuyoud.api.service import FuyouServicer

__all__ = ["Admission", "AdminAuth", "FuyouAdminServicer", "FuyouServicer", "MalformedRequests", "Services"]
