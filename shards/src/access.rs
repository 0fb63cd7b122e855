//! Access control for one connection: the ACL file's rules applied to the
//! signed-in identity (DESIGN.md §9, §15).

use std::sync::Arc;

use fleetmq_core::session::Authorize;

use crate::auth::acl::Action;
use crate::auth::{Authenticator, Identity};

/// Checks one client's publishes, subscriptions and deliveries against the
/// ACL in force. It asks the authenticator for the current ACL on every
/// check, so a reload applies to connected clients too (deliveries within
/// `auth.acl_cache_ttl`, the session's cache of decisions).
pub(crate) struct AclAuthorizer {
    auth: Arc<Authenticator>,
    username: Option<Arc<str>>,
    workspace: Arc<str>,
    client_id: String,
}

impl AclAuthorizer {
    /// The authorizer for `identity` connected as `client_id`, or `None`
    /// when no ACL file is configured (everything allowed).
    pub(crate) fn for_client(auth: &Arc<Authenticator>, identity: &Identity, client_id: &str) -> Option<Arc<dyn Authorize>> {
        auth.acl()?;
        Some(Arc::new(AclAuthorizer {
            auth: auth.clone(),
            username: identity.username.clone(),
            workspace: identity.workspace.clone(),
            client_id: client_id.to_owned(),
        }))
    }

    fn check(&self, action: Action, topic: &str) -> bool {
        match self.auth.acl() {
            Some(acl) => acl.check(self.username.as_deref(), &self.workspace, &self.client_id, action, topic),
            None => true,
        }
    }
}

impl Authorize for AclAuthorizer {
    fn may_publish(&self, topic: &str) -> bool {
        self.check(Action::Publish, topic)
    }

    fn may_subscribe(&self, filter: &str) -> bool {
        self.check(Action::Subscribe, filter)
    }

    fn may_receive(&self, topic: &str) -> bool {
        self.check(Action::Subscribe, topic)
    }
}
