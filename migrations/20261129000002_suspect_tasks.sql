-- A task that was in flight on a worker that died beside other tasks is a suspect: any of
-- them may have crashed it. Suspects run alone on their next try (decision 0008).
ALTER TABLE tasks ADD COLUMN suspect boolean NOT NULL DEFAULT false;
