"""Security without sockets: settings (Kafka's key names), TLS contexts and certificate principals, SCRAM
credentials and exchanges, ACLs and their evaluation. The server, the client and the zk layer build on
it; docs/security.md tells the whole story."""
from metaq_broker.errors import AuthenticationError, AuthorizationError
from metaq_broker.security.settings import BrokerSecurity, ClientSecurity, load_properties

__all__ = ["AuthenticationError", "AuthorizationError", "BrokerSecurity", "ClientSecurity", "load_properties"]
