"""Money: the day's and the month's dollar budgets, the ledger of what each
pod was admitted for and what it cost, and where the money went.

The core here never imports Prefect: `budgets` (what may be spent), `ledger`
(the entries, their totals, the admission and its refusal line), `store`
(the ledger's file under a lock a dead holder cannot keep), `pods` (what a
launch plan asks of the budget and what a pod's record says it cost), `chart`
(the spend as SVG bars), `spend` (where the money went: the ledger brought up
to date and reconciled with the providers' bills), `limits` (the GPU budget's
two concurrency limits). Where the budgets are set and the spend is shown is
in `server_budget.py` and `flows/spend.py`.
"""
