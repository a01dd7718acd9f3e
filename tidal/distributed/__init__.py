"""Transport between processes (layer 2): stateless process groups on a TCPStore
(``groups``), free-port helpers (``ports``) and authentication of the ZMQ control plane
(``zmq_auth``).

Importing the package imports nothing: ``groups`` pulls in torch, ``zmq_auth`` zmq, and
a frontend that only needs a port must not pay for either.
"""
