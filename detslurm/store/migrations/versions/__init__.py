"""The store's Alembic revisions. Each file is named ``<revision>_<words>.py`` after the revision
it holds (tests/unit/store/test_store.py checks it). The ids of applied revisions never change, since
existing stores are stamped with them, so the order is the chain of ``down_revision``, not the
names' order: 0001, 0002, 0003_verbs, 0003_dashboard, 0004_cli15, 0003_preempt2. A new revision
takes the next free number (0005_...)."""
