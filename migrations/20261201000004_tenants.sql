-- Tenancy (issue 11, decision 0012): a task belongs to a tenant, its TaskType's namespace in
-- a cluster and `default` outside one. Idempotency keys are unique per tenant, so the same
-- key from two tenants makes two tasks and a 409 never names another tenant's task. Rows
-- from before belong to `default`; `conveyorctl adopt` moves a type's rows and messages
-- into the namespace of its TaskType.
ALTER TABLE tasks ADD COLUMN tenant text NOT NULL DEFAULT 'default';
ALTER TABLE tasks DROP CONSTRAINT tasks_idempotency_key_key;
CREATE UNIQUE INDEX tasks_tenant_idempotency_key ON tasks (tenant, idempotency_key);
