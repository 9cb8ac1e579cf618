-- Least privilege for a tenant's workers (issue 11, decision 0013): row-level security on
-- the tables they touch. The tables' owner (gateway, operator, upkeep, conveyorctl) is not
-- subject to it; a tenant's role (`conveyorctl grant`) sees and changes only its tenant's
-- rows through the policies made for it. With no policy for a role, it sees nothing.
ALTER TABLE tasks ENABLE ROW LEVEL SECURITY;
ALTER TABLE task_events ENABLE ROW LEVEL SECURITY;
ALTER TABLE queue_probes ENABLE ROW LEVEL SECURITY;
