"""The speculation vocabulary shared by every service: methods, the draft-link messages,
the proposer interface and the Leviathan cost model (docs/design/brief.md, "The speculation
loop")."""
from tandem.spec.methods import API_NAMES, Method
from tandem.spec.proposer import (
    DraftRequest,
    DraftResult,
    Learner,
    Proposer,
    propose_isolated,
)
from tandem.spec.protocol import (
    Close,
    Commit,
    Control,
    DraftToken,
    ErrorCode,
    Features,
    Invalid,
    Open,
    Proposal,
    Reply,
    SessionError,
    TreeNode,
)

__all__ = ["API_NAMES", "Close", "Commit", "Control", "DraftRequest", "DraftResult",
           "DraftToken", "ErrorCode", "Features", "Invalid", "Learner", "Method", "Open",
           "Proposal", "Proposer", "Reply", "SessionError", "TreeNode", "propose_isolated"]
